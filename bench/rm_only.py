"""A run that learns from a reward model alone (issue 34), in the deterministic in-process loop
(tests/support/inprocess_rl.py: the real learner, corridor env, prompt format and parser, the policy sampled with
torch from the learner's weights, the reward from the configured components).

    python bench/rm_only.py --jobs 2                     # default corridor, seeds 0-2, the `goal` run beside each
    python bench/rm_only.py --seeds 0 --steps 20 --rewards reward_model

1. The tiny model is built and warm-started on the task (seed 0, `--warmstart-steps`) into `--build-dir`, once.
2. Preference pairs: before any RL that policy plays `--pair-tasks` train tasks `--pair-size` times each at each of
   `--pair-temperatures` (the hotter episodes hold the malformed replies an RL run would otherwise find the reward
   model knows nothing of); each task's successes are paired with its failures (services/reward/preference_pairs.py).
3. A reward model is trained on them from the policy's weights (services/reward/train_rm.py); held-out accuracy.
4. Per seed, an RL run whose only reward component is that `reward_model` (`input: tokens`) and one whose only
   reward is the env's `goal` (`--rewards`). Per step: the true success (the env's, which the reward model never
   reads) beside the mean reward; the seconds the reward model's forwards took against the whole step.
5. Scoring cost at the recipe's batch: one step's 16 groups of 8 pre-RL episodes scored by the component in one
   call, one call a group and one call an episode.

Steps 1-3 are kept in `--build-dir` and reused (delete it to redo them). RL settings: configs/tiny_model_rl.yaml
(GRPO, 16 groups of 8, 2 epochs, lr 1e-3 cosine, KL and entropy terms), replies capped at 8 tokens (a reply is 4),
the learner on the CPU; `--set` adds overrides. GRPO because GiGPO's step level reads the env's per-turn rewards.
Runs go `--jobs` at a time, one process and `--threads` torch threads each. JSON goes to `--out` (default
bench/results/)."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.result_path import result_path  # noqa: E402

FORWARD_SECONDS = "omrl_reward_model_forward_seconds_sum"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--options", default="{}", help="corridor's env.options (YAML)")
    parser.add_argument("--build-dir", default="runs/bench-rm-only")
    parser.add_argument("--warmstart-steps", type=int, default=150)
    parser.add_argument("--pair-tasks", type=int, default=128, help="tasks played at each pair temperature")
    parser.add_argument("--pair-size", type=int, default=8, help="episodes of each task")
    parser.add_argument("--pair-temperatures", default="1.0,1.5")
    parser.add_argument("--rm-epochs", type=int, default=3)
    parser.add_argument("--build-only", action="store_true", help="stop after training the reward model")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rewards", default="reward_model,goal", help="the runs of each seed, by their one reward")
    parser.add_argument("--last", type=int, default=3, help="final success: mean of the last this many steps")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, one process each")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    parser.add_argument("--set", action="append", default=[], help="a config override, e.g. algorithm.lr=5e-4")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import services.plugins  # noqa: F401  (configs are checked against every plugin registry)

    build = Path(args.build_dir)
    model = build_model(args, build)
    rm, report = reward_model(args, model, build)
    print(
        f"reward model: {report['train_pairs']} train / {report['held_out_pairs']} held-out pairs, accuracy "
        f"{report['held_out_accuracy']:.1%} held out ({report['train_accuracy']:.1%} train), {report['seconds']:.0f} s"
    )
    if args.build_only:
        return 0
    jobs = [(int(seed), name) for seed in args.seeds.split(",") for name in args.rewards.split(",")]
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        done = list(pool.map(partial(run, args, model, rm), [s for s, _ in jobs], [n for _, n in jobs]))
    runs: dict[str, dict] = {}
    for (seed, name), result in zip(jobs, done):
        runs.setdefault(str(seed), {})[name] = result
    summary = summarize(runs, args.last)
    scoring = default_batch_scoring(args, model, rm)
    print(
        f"scoring one recipe step ({scoring['episodes']} pre-RL episodes) with the reward model: "
        f"{scoring['batched_s']:.3f} s in one call, {scoring['per_group_s']:.3f} s one call a group of 8, "
        f"{scoring['one_by_one_s']:.3f} s one call an episode"
    )
    out = result_path(args.out, "rm_only")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in vars(args).items() if k != "out"} | {"model": model, "rm": rm}
    result = {**meta, "load_avg_at_end": os.getloadavg(), "rm_training": report, "runs": runs, **summary}
    out.write_text(json.dumps({**result, "scoring": scoring}, indent=1))
    print(f"wrote {out}")
    return 0


def build_model(args, build: Path) -> str:
    from services.common.config import load_config
    from services.launcher.tiny import prepare_tiny_model

    done = build / "model.built"
    if not done.exists():
        warm = ["env.name=corridor", f"env.options={args.options}", f"model.warmstart_steps={args.warmstart_steps}"]
        done.parent.mkdir(parents=True, exist_ok=True)
        done.write_text(str(prepare_tiny_model(load_config(None, warm), build / "model", say=print)))
    return done.read_text()


def rl_config(args, seed: int, reward: dict):
    from services.common.config import load_config
    from tests.support.inprocess_rl import RECIPE

    task = ["env.name=corridor", f"env.options={args.options}", "learner.device=cpu", "rollout.max_new_tokens=8"]
    run = [f"seed={seed}", f"learner.steps={args.steps}", f"reward.components={json.dumps(reward)}"]
    return load_config(RECIPE, [*task, *run, *args.set])


def play_before_rl(args, model: str, tasks: int, size: int, temperature: float, seed: int) -> list:
    """`size` episodes of each of `tasks` train tasks (drawn with `seed`) by the policy at `model`, no training."""
    import torch

    from tests.support.inprocess_rl import deterministic_torch, policy_rollout

    config = rl_config(args, seed, {"goal": {"weight": 1.0}})
    rng = random.Random(f"pairs:{seed}")
    drawn = [rng.randrange(config.env.train_tasks) for _ in range(tasks)]
    with deterministic_torch(args.threads):
        rollout = policy_rollout(config, model)
        return rollout.play(drawn, torch.Generator().manual_seed(seed), 0, 0, size=size, temperature=temperature)


def reward_model(args, model: str, build: Path) -> tuple[str, dict]:
    from services.reward.preference_pairs import pair_episodes, write_pairs
    from services.reward.train_rm import REPORT_FILE, Settings, train_reward_model
    from tests.support.inprocess_rl import deterministic_torch

    rm = build / "rm"
    if not (rm / REPORT_FILE).exists():
        start, played = time.perf_counter(), []
        for i, temperature in enumerate(float(t) for t in args.pair_temperatures.split(",")):
            played += play_before_rl(args, model, args.pair_tasks, args.pair_size, temperature, seed=i)
        pairs = pair_episodes(played, seed=0)
        write_pairs(pairs, build / "pairs.jsonl")
        won, took = sum(t.success for t in played) / len(played), time.perf_counter() - start
        print(f"pairs: {len(played)} episodes, success {won:.1%}, {len(pairs)} pairs ({took:.0f} s)")
        with deterministic_torch(args.threads):
            train_reward_model(pairs, model, rm, Settings(epochs=args.rm_epochs), say=print)
    return str(rm), json.loads((rm / REPORT_FILE).read_text())


def run(args, model: str, rm: str, seed: int, name: str) -> dict:
    """One RL run whose only reward is `name` (`reward_model` or `goal`), in this process."""
    from prometheus_client import REGISTRY

    import services.plugins  # noqa: F401
    from tests.support.inprocess_rl import train

    rewards = {
        "reward_model": {"reward_model": {"weight": 1.0, "params": {"path": rm, "max_wait_ms": 0}}},
        "goal": {"goal": {"weight": 1.0}},
    }
    forwarded = lambda: REGISTRY.get_sample_value(FORWARD_SECONDS, {"component": "reward_model"}) or 0.0  # noqa: E731
    before, start = forwarded(), time.perf_counter()  # a worker process runs several runs
    curve = train(rl_config(args, seed, rewards[name]), model, threads=args.threads)
    took, forward = time.perf_counter() - start, forwarded() - before
    final = statistics.mean(curve.success[-args.last :])
    lines = [
        f"success {' '.join(f'{s:.0%}' for s in curve.success)}  (last {args.last}: {final:.0%}; {took:.0f} s)",
        f"reward  {' '.join(f'{r:+.2f}' for r in curve.reward)}",
    ]
    if name == "reward_model":
        lines.append(f"reward-model forwards {forward:.1f} s of {sum(curve.seconds):.1f} s of steps")
    print("\n".join(f"seed {seed} {name:12}: {line}" for line in lines), flush=True)
    return {"success": curve.success, "reward": curve.reward, "step_seconds": curve.seconds, "rm_forward_s": forward}


def summarize(runs: dict, last: int) -> dict:
    """Medians over seeds: step-1 success, each reward's success over the last `last` steps, the share of the step
    the reward model's forwards took."""
    names = list(next(iter(runs.values())))
    median = lambda values: statistics.median(list(values))  # noqa: E731
    first = median(r[names[0]]["success"][0] for r in runs.values())
    final = {name: median(statistics.mean(r[name]["success"][-last:]) for r in runs.values()) for name in names}
    out = {"median_step1_success": first, "median_final_success": final}
    line = ", ".join(f"{name} {value:.0%}" for name, value in final.items())
    if "reward_model" in names:
        model = [r["reward_model"] for r in runs.values()]
        out["median_rm_share_of_step"] = median(r["rm_forward_s"] / sum(r["step_seconds"]) for r in model)
        line += f"; reward-model forwards {out['median_rm_share_of_step']:.1%} of the step"
    print(f"median over {len(runs)} seeds: step 1 success {first:.0%}; last {last} steps: {line}")
    return out


def default_batch_scoring(args, model: str, rm: str) -> dict:
    """Seconds to score one recipe step (16 groups of 8 pre-RL episodes) with the component: all in one call (passes
    of `max_batch` 32, as the batcher runs concurrent Score calls), one call a group (the rollout's Score call) and
    one call an episode (as the in-process loop scores)."""
    from services.reward.reward_model import RewardModel
    from tests.support.inprocess_rl import deterministic_torch

    episodes = play_before_rl(args, model, 16, 8, 1.0, seed=99)
    calls = {"batched_s": [episodes], "per_group_s": [episodes[i : i + 8] for i in range(0, 128, 8)]}
    calls["one_by_one_s"] = [[traj] for traj in episodes]
    out: dict = {"episodes": len(episodes)}
    with deterministic_torch(args.threads):
        component = RewardModel(rm, max_wait_ms=0)
        component.score_batch(episodes[:8])  # warm-up
        for name, batches in calls.items():
            start = time.perf_counter()
            for batch in batches:
                component.score_batch(batch)
            out[name] = time.perf_counter() - start
    return out


if __name__ == "__main__":
    sys.exit(main())
