"""The agent loop's front-process cost, variants interleaved on one engine (the agent-loop side of
bench/vs_vllm.py: 512 one-turn corridor episodes, env service in-process). Per pass: wall, tokens/s, the
front process's CPU seconds (`time.process_time`: the loop, the env service's threads, vLLM's input and
output processing; not the engine core or worker), and when the engine requests went in and came back.

Variants (the same engine, passes interleaved a, b, a, b, ... after one warm-up pass):
  new      the code as it is, with the settings of configs/tiny_model_rl.yaml: vLLM's own Prometheus
           series off (`rollout.vllm_metrics: false`), the corridor env's calls inline on the env
           service's event loop (`TextEnv.runs_inline`)
  old      `new` with the first prompt rendered and tokenised per episode, vLLM's deep copy of each
           SamplingParams (the behaviour before the front-CPU cut of issue 12)
  prom     `new` with `rollout.vllm_metrics` on (the default outside the CPU recipe): the engine's stat
           loggers swapped per pass for those the backend gives vLLM with that setting
  threaded `new` with the env's calls on the env service's worker threads (`runs_inline` False, as for an
           env that may block)
  single   `new` with one env create per episode, each from its own episode (before CreateBatch)
  nocache  `new` with vLLM's envs cache off in this process (before the backend turned it on)
  before   `single` and `nocache` together (the code before CreateBatch and the envs cache)

    python bench/loop_front.py --model-dir runs/bench-vs-trl/model-tiny/warm --variants old,new --passes 5
    python bench/loop_front.py --model-dir runs/bench-vs-vllm/model/warm --variants new,prom,threaded --passes 4

JSON goes to `--out` (default bench/results/loop_front_<time>.json)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import vs_vllm  # noqa: E402
from bench.result_path import result_path  # noqa: E402


def _quantiles(xs: list[float]) -> list[float]:
    xs = sorted(xs)
    return [round(xs[min(len(xs) - 1, int(len(xs) * q))], 3) for q in (0.1, 0.5, 0.9)] + [round(xs[-1], 3)]


def stat_logger_switch(backend, vllm_metrics: bool):
    """Sets the started engine's stat loggers to those it would have been built with under
    `rollout.vllm_metrics` = the argument: a `StatLoggerManager` built as `AsyncLLM` builds its own, from
    the backend's `stat_loggers`, and put in place as vLLM's own elastic scale-up replaces it."""
    from vllm.v1.metrics.loggers import StatLoggerManager, load_stat_logger_plugin_factories

    from services.engines.vllm import stat_loggers

    engine = backend._engine
    managers = {vllm_metrics: engine.logger_manager}

    def use(metrics_on: bool) -> None:
        if metrics_on not in managers:
            managers[metrics_on] = StatLoggerManager(
                vllm_config=engine.vllm_config,
                engine_idxs=engine.engine_core.engine_ranks_managed,
                custom_stat_loggers=[*stat_loggers(metrics_on), *load_stat_logger_plugin_factories()],
                enable_default_loggers=not backend._engine_args.disable_log_stats,
            )
            managers[metrics_on].log_engine_initialized()
        engine.logger_manager = managers[metrics_on]
        if hasattr(engine, "_logger_ref"):  # the output handler's reference, once it runs
            engine._logger_ref[0] = managers[metrics_on]

    return use


async def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm import envs as vllm_envs

    import services.engines.vllm as vllm_backend
    from services.envs import service as env_service
    from services.envs.client import InProcessEnvClient
    from services.envs.registry import ENVS
    from services.rollout.action_parsers import PARSERS
    from services.rollout.agent_loop import AgentLoop
    from services.rollout.app import build_backend
    from services.rollout.core import RolloutCore
    from services.rollout.prompting import ChatFormatter

    config, groups = vs_vllm.load(args), vs_vllm.episodes(args)
    backend = build_backend(config)
    await backend.start()
    sent: list[float] = []
    back: list[float] = []
    generate = backend.generate

    async def timed_generate(*a, **k):
        sent.append(time.perf_counter())
        try:
            return await generate(*a, **k)
        finally:
            back.append(time.perf_counter())

    backend.generate = timed_generate
    core = RolloutCore(backend, config.model.path)
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)

    class OldFormatter(ChatFormatter):
        def initial(self, observation):
            return self._encode(self._render([*self.system, {"role": "user", "content": observation}], True))

    def deep_copied(**kw):
        return SamplingParams(**{**kw, "skip_clone": False})

    env_class = ENVS.get(config.env.name)
    runs_inline = env_class.runs_inline
    use_stat_loggers = stat_logger_switch(backend, config.rollout.vllm_metrics)

    async def single_creates(task_index, count):
        return [None] * count  # each episode creates its own environment

    def make_loop(variant: str) -> AgentLoop:
        env_class.runs_inline = runs_inline and variant != "threaded"
        (vllm_envs.disable_envs_cache if variant in ("nocache", "before") else vllm_envs.enable_envs_cache)()
        use_stat_loggers(variant == "prom" or config.rollout.vllm_metrics)
        vllm_backend.SamplingParams = deep_copied if variant == "old" else SamplingParams
        formatter = (OldFormatter if variant == "old" else ChatFormatter)(tokenizer)
        loop = AgentLoop(
            core,
            InProcessEnvClient(env_service.EnvService()),
            formatter,
            PARSERS.create(config.rollout.action_parser),
            config.rollout,
            config.env,
            config.model.max_model_len,
        )
        if variant in ("single", "before"):
            loop._create_group = single_creates
        return loop

    variants = args.variants.split(",")
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        warm = make_loop(variants[0])
        await asyncio.gather(*(warm.run_group(t, seed=s) for t, s in groups))
        for i in range(args.passes):
            for v in variants:
                loop = make_loop(v)
                sent.clear()
                back.clear()
                cpu0, t0 = time.process_time(), time.perf_counter()
                out = await asyncio.gather(*(loop.run_group(t, seed=s) for t, s in groups))
                wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                tokens = sum(traj.turns[0].model_tokens for group in out for traj in group)
                row = {
                    "wall_s": round(wall, 3),
                    "tokens": tokens,
                    "tokens_per_s": round(tokens / wall, 1),
                    "front_cpu_s": round(cpu, 3),
                    "sent_at_s_q10_q50_q90_last": _quantiles([x - t0 for x in sent]),
                    "back_at_s_q10_q50_q90_last": _quantiles([x - t0 for x in back]),
                }
                rows[v].append(row)
                print(f"pass {i} {v}: {row}", flush=True)
    finally:
        env_class.runs_inline = runs_inline
        vllm_backend.SamplingParams = SamplingParams
        await backend.shutdown()
    return {
        "variants": {
            v: {
                "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[v]),
                "median_front_cpu_s": statistics.median(r["front_cpu_s"] for r in rows[v]),
                "passes": rows[v],
            }
            for v in variants
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--episodes", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--variants", default="old,new")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    result.update(cores=len(os.sched_getaffinity(0)), load_avg_at_end=os.getloadavg(), episodes=args.episodes)
    for v, s in result["variants"].items():
        print(f"{v}: median {s['median_tokens_per_s']} tok/s, front CPU {s['median_front_cpu_s']} s a pass")
    out = result_path(args.out, "loop_front")
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
