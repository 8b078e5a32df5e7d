"""The rollout agent loop on its vLLM backend against bare vLLM `LLM.generate`, in one process: the same
one-turn corridor episodes (prompt ids from the loop's own ChatFormatter), per-episode seeds and sampling
(temperature 1, <= 16 new tokens, the model's stop tokens, the sampled token's logprob).

  agent loop  RolloutCore over VllmBackend (AsyncLLM) driven by AgentLoop.run_group, the env service
              in-process (InProcessEnvClient): the rollout server's path minus gRPC and Redis
  bare vLLM   LLM(...).generate over the same prompt ids, one call, with the same engine arguments

    python bench/vs_vllm.py --runs 3               # 512 episodes (64 groups x 8), tiny warm-started model

Per round each side starts its own engine (the other one shut down: an idle vLLM CPU engine still spins),
plays one warm-up pass, then `--passes` timed passes (the median pass counts). tokens/s = generated
tokens / wall time of the pass. The token sequences of both sides are compared episode by episode (same
seed => same sample, batch composition aside). JSON goes to `--out` (default bench/results/vs_vllm_<time>.json)."""

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

from bench.result_path import result_path  # noqa: E402

CONFIG = ROOT / "configs" / "tiny_model_rl.yaml"
OPTIONS = {"distance": 1, "max_turns": 1}


def load(args: argparse.Namespace):
    from services.common.config import load_config

    return load_config(
        str(CONFIG),
        [
            f"env.options={json.dumps(OPTIONS)}",
            "env.max_turns=1",
            f"rollout.group_size={args.group_size}",
            "rollout.max_new_tokens=16",
            *([f"model.path={args.model_dir}"] if args.model_dir else []),
            *args.set,
        ],
    )


def episodes(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(task index, group seed) of every group; episode i of a group samples with seed group_seed*1000 + i."""
    return [(g, g) for g in range(args.episodes // args.group_size)]


async def agent_loop_side(config, groups, passes: int) -> list[dict]:
    from transformers import AutoTokenizer

    from services.envs.client import InProcessEnvClient
    from services.envs.service import EnvService
    from services.rollout.action_parsers import PARSERS
    from services.rollout.agent_loop import AgentLoop
    from services.rollout.app import build_backend
    from services.rollout.core import RolloutCore
    from services.rollout.prompting import ChatFormatter

    backend = build_backend(config)
    await backend.start()
    try:
        core = RolloutCore(backend, config.model.path)
        loop = AgentLoop(
            core,
            InProcessEnvClient(EnvService()),
            ChatFormatter(AutoTokenizer.from_pretrained(config.model.path)),
            PARSERS.create(config.rollout.action_parser),
            config.rollout,
            config.env,
            config.model.max_model_len,
        )
        out = []
        for _ in range(passes):
            start = time.perf_counter()
            results = await asyncio.gather(*(loop.run_group(task, seed=seed) for task, seed in groups))
            wall = time.perf_counter() - start
            seqs = {}
            for (task, seed), group in zip(groups, results, strict=True):
                for i, traj in enumerate(group):
                    p, n = traj.prompt_length, traj.turns[0].model_tokens
                    seqs[seed * 1000 + i] = list(traj.token_ids[p : p + n])
            out.append({"wall_s": wall, "seqs": seqs})
        return out
    finally:
        await backend.shutdown()


def bare_side(config, groups, passes: int) -> list[dict]:
    import psutil
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.platforms import current_platform

    from services.engines.vllm import WORKER_EXTENSION
    from services.engines.vllm_args import engine_kwargs
    from services.envs.builtin.corridor import Corridor
    from services.rollout.prompting import ChatFormatter

    m, r = config.model, config.rollout
    formatter = ChatFormatter(AutoTokenizer.from_pretrained(m.path))
    kwargs = engine_kwargs(
        model=m.path,
        dtype=m.dtype,
        max_model_len=m.max_model_len,
        gpu_memory_utilization=r.gpu_memory_utilization,
        max_num_seqs=r.max_num_seqs,
        enforce_eager=r.enforce_eager,
        seed=config.seed,
        gpus=r.gpus,
        on_cpu=current_platform.is_cpu(),
        ram_bytes=psutil.virtual_memory().total,
        worker_extension=WORKER_EXTENSION,
        logprobs_mode="processed_logprobs",
        engine_args=r.engine_args,
    )
    saved = dict(os.environ)
    llm = LLM(**kwargs)
    os.environ.clear()
    os.environ.update(saved)
    prompts, params, keys = [], [], []
    for task, seed in groups:
        ids = formatter.initial(Corridor().reset(task, config.env.options))
        for i in range(r.group_size):
            prompts.append(TokensPrompt(prompt_token_ids=ids))
            params.append(
                SamplingParams(
                    max_tokens=r.max_new_tokens,
                    temperature=r.temperature,
                    top_p=r.top_p,
                    top_k=r.top_k,
                    stop_token_ids=list(formatter.stop_token_ids),
                    seed=seed * 1000 + i,
                    logprobs=0,
                    detokenize=False,
                )
            )
            keys.append(seed * 1000 + i)
    out = []
    try:
        for _ in range(passes):
            start = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            out.append({"wall_s": wall, "seqs": {k: list(o.outputs[0].token_ids) for k, o in zip(keys, results)}})
        return out
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


def summarize_pass(p: dict) -> dict:
    tokens = sum(len(s) for s in p["seqs"].values())
    return {"wall_s": round(p["wall_s"], 3), "tokens": tokens, "tokens_per_s": round(tokens / p["wall_s"], 1)}


def median_pass(passes: list[dict]) -> dict:
    rows = [summarize_pass(p) for p in passes]
    return {
        **sorted(rows, key=lambda r: r["tokens_per_s"])[len(rows) // 2],
        "passes_tokens_per_s": [r["tokens_per_s"] for r in rows],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", help="model directory (default: build the warm-started tiny model)")
    ap.add_argument("--episodes", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--runs", type=int, default=1, help="rounds; each starts both engines afresh")
    ap.add_argument("--passes", type=int, default=3, help="timed passes per engine after the warm-up (median)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    ap.add_argument("--work-dir", default=str(ROOT / "runs" / "bench-vs-vllm"))
    ap.add_argument("--out")
    args = ap.parse_args()
    config = load(args)
    if not config.model.path:
        from services.launcher.tiny import prepare_tiny_model

        model = Path(args.work_dir) / "model"
        built = model / "warm" if (model / "warm" / "config.json").exists() else None
        config.model.path = str(built or prepare_tiny_model(config, model, print))
    groups = episodes(args)
    rounds = []
    for i in range(args.runs):
        loop_passes = asyncio.run(agent_loop_side(config, groups, passes=args.passes + 1))
        bare_passes = bare_side(config, groups, passes=args.passes + 1)
        a, b = loop_passes[-1], bare_passes[-1]  # the first pass warms the engine
        same = sum(a["seqs"][k] == b["seqs"].get(k) for k in a["seqs"])
        row = {
            "agent_loop": median_pass(loop_passes[1:]),
            "bare_vllm": median_pass(bare_passes[1:]),
            "warmup": {"agent_loop": summarize_pass(loop_passes[0]), "bare_vllm": summarize_pass(bare_passes[0])},
            "identical_sequences": same,
            "episodes": len(a["seqs"]),
        }
        row["ratio"] = round(row["agent_loop"]["tokens_per_s"] / row["bare_vllm"]["tokens_per_s"], 3)
        rounds.append(row)
        print(
            f"round {i}: agent loop {row['agent_loop']['tokens_per_s']} tok/s ({row['agent_loop']['tokens']} tokens, "
            f"{row['agent_loop']['wall_s']}s) | bare vLLM {row['bare_vllm']['tokens_per_s']} tok/s "
            f"({row['bare_vllm']['tokens']} tokens, {row['bare_vllm']['wall_s']}s) | ratio {row['ratio']} | "
            f"identical sequences {same}/{len(a['seqs'])}",
            flush=True,
        )
    ratios = [r["ratio"] for r in rounds]
    summary = {
        "model_dir": config.model.path,
        "episodes": args.episodes,
        "cores": len(os.sched_getaffinity(0)),
        "load_avg_at_end": os.getloadavg(),
        "median_agent_loop_tokens_per_s": statistics.median(r["agent_loop"]["tokens_per_s"] for r in rounds),
        "median_bare_vllm_tokens_per_s": statistics.median(r["bare_vllm"]["tokens_per_s"] for r in rounds),
        "median_ratio": statistics.median(ratios),
        "rounds": rounds,
    }
    print(
        f"median: agent loop {summary['median_agent_loop_tokens_per_s']} tok/s, bare vLLM "
        f"{summary['median_bare_vllm_tokens_per_s']} tok/s, ratio {summary['median_ratio']} (rounds {ratios})"
    )
    out = result_path(args.out, "vs_vllm")
    out.write_text(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
