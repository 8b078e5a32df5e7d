"""Dynamic sampling (DAPO) on and off in one process, deterministic (tests/support/inprocess_rl.py): the real
learner, envs, prompt format, parser and reward functions, the policy sampled with torch from the learner's weights.
Per seed, the same model, tasks (each step's first groups) and step budget with and without
`algorithm.dynamic_sampling`; per step and at the end: validation success (held-out tasks, each played once at
`--validation-temperature`) at each validation point, zero-advantage groups trained, groups dropped, episodes
played and wall time.

    python bench/dynamic_sampling.py --seeds 0,1,2 --steps 20 --jobs 6
    python bench/dynamic_sampling.py --model runs/bench-dynamic-sampling/warm --seeds 0 --steps 3 --validate-every 1

The default task mixes difficulties so that uniform groups come from the tasks, not the policy: corridor
`{length: 8, distances: [1, 3, 5], max_turns: 3}` (a third of the tasks 1 cell away, a third 3, a third 5: out of
reach in 3 moves, so every group on them fails whole). Without `--model` the tiny model is built and warm-started
on corridor with 3 moves (the learning tests' model) into `--build-dir`, once. The learner's settings are
configs/tiny_model_rl.yaml (16 groups of 8, GRPO, lr 1e-3 cosine) with `LOOP` on top (`--set` adds more). Each
(seed, setting) runs in its own process, `--jobs` at a time, `--threads` torch threads each. JSON goes to `--out`
(default bench/results/)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gigpo_vs_grpo import build_model  # noqa: E402
from bench.result_path import result_path  # noqa: E402

LOOP = [
    "learner.device=cpu",
    "rollout.max_new_tokens=8",  # a reply is 4 tokens; one that runs on is invalid anyway
    "env.max_turns=50",  # the env's own limit ends an episode
]
"""The in-process loop's settings over the recipe (as `inprocess_rl.RACE` sets them), the learner's left as the
recipe has them."""
SETTINGS = {"off": "false", "on": "true"}


def main() -> int:
    args = parse_args()
    from services.common.config import load_config

    warm = [f"env.name={args.env}", f"env.options={args.warmstart_options}"]
    warm.append(f"model.warmstart_steps={args.warmstart_steps}")
    model = args.model or build_model(load_config(None, warm), Path(args.build_dir))
    seeds = [int(s) for s in args.seeds.split(",")]
    out = result_path(args.out, "dynamic_sampling")
    out.parent.mkdir(parents=True, exist_ok=True)
    start, results = time.perf_counter(), {}
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(one_run, args, model, seed, s): (seed, s) for seed in seeds for s in SETTINGS}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            write(out, args, model, results)  # each run as it ends: a call cut short keeps what finished
    print(f"all runs: {time.perf_counter() - start:.0f} s on {args.jobs} processes")
    report(results, seeds)
    print(f"wrote {out}")
    return 0


def write(out: Path, args: argparse.Namespace, model: str, results: dict[tuple[int, str], dict]) -> None:
    meta = {k: getattr(args, k) for k in ("env", "options", "steps", "set", "threads", "validate_every")}
    meta |= {"model": model, "validation_tasks": args.validation_tasks, "load_avg_at_end": os.getloadavg()}
    runs: dict[str, dict] = {}
    for (seed, setting), result in sorted(results.items()):
        runs.setdefault(str(seed), {})[setting] = result
    out.write_text(json.dumps({**meta, "runs": runs}, indent=1))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="corridor")
    parser.add_argument("--options", default="{length: 8, distances: [1, 3, 5], max_turns: 3}")
    parser.add_argument("--warmstart-options", default="{max_turns: 3}", help="env.options of the model's warm-start")
    parser.add_argument("--model", default=None, help="a Hugging Face model dir; default: build one")
    parser.add_argument("--build-dir", default="runs/bench-dynamic-sampling")
    parser.add_argument("--warmstart-steps", type=int, default=150)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--validate-every", type=int, default=5)
    parser.add_argument("--validation-tasks", type=int, default=512)
    parser.add_argument("--validation-temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, one process each")
    parser.add_argument("--set", action="append", default=[], help="a config override, e.g. rollout.group_size=4")
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def one_run(args: argparse.Namespace, model: str, seed: int, setting: str) -> dict:
    """One run in a process of its own: its curve, wall time and, if a step failed, why."""
    from services.learner.service import DynamicSamplingExhausted
    from tests.support.inprocess_rl import Curve, train

    config = run_config(args, seed, setting)
    curve, failed = Curve(), None
    start = time.perf_counter()
    say = lambda line: print(f"seed {seed} {setting:3} {line}", flush=True)  # noqa: E731
    try:
        train(config, model, threads=args.threads, say=lambda _: say(step_line(curve)), curve=curve)
    except DynamicSamplingExhausted as exc:  # the steps before it stand
        failed = str(exc)
        say(f"failed: {failed}")
    took = time.perf_counter() - start
    validation = {str(v): curve.validation_success(v) for v in curve.validation}
    say(f"done in {took:.0f} s; validation {fmt_points(validation)}")
    return {
        **{k: v for k, v in asdict(curve).items() if k not in ("validation", "held_out")},
        "validation_success": validation,
        "validation_by_distance": by_distance(config, curve),
        "groups_per_step": config.rollout.groups_per_step,
        "wall_seconds": took,
        "failed": failed,
    }


def run_config(args: argparse.Namespace, seed: int, setting: str):
    from services.common.config import load_config
    from tests.support.inprocess_rl import RECIPE

    task = [f"env.name={args.env}", f"env.options={args.options}"]
    validation = [
        f"env.validation_every={args.validate_every}",
        f"env.validation_tasks={args.validation_tasks}",
        f"env.validation_temperature={args.validation_temperature}",
    ]
    run = [f"algorithm.dynamic_sampling={SETTINGS[setting]}", f"seed={seed}", f"learner.steps={args.steps}"]
    return load_config(RECIPE, [*task, *LOOP, *validation, *run, *args.set])


def by_distance(config, curve) -> dict[str, dict[str, float]]:
    """Corridor with `distances`: each validation point's success per exit distance."""
    options = config.env.options
    if config.env.name != "corridor" or not options.get("distances"):
        return {}
    from services.envs.builtin.corridor import CorridorOptions

    distance_of = CorridorOptions.model_validate(options).distance_of
    out: dict[str, dict[str, float]] = {}
    for version, won in curve.validation.items():
        tally: dict[int, list[bool]] = {}
        for task, success in zip(curve.held_out, won):
            tally.setdefault(distance_of(task), []).append(success)
        out[str(version)] = {str(d): sum(w) / len(w) for d, w in sorted(tally.items())}
    return out


def step_line(curve) -> str:
    step = len(curve.success)
    line = (
        f"step {step}: batch success {curve.success[-1]:.0%}, zero-advantage groups {curve.uniform[-1]}, "
        f"dropped {curve.dropped[-1]}, episodes {curve.episodes[-1]}, {curve.seconds[-1]:.1f} s"
    )
    if step - 1 in curve.validation:
        line += f"; validation v{step - 1} {curve.validation_success(step - 1):.1%}"
    return line


def fmt_points(validation: dict[str, float]) -> str:
    return " / ".join(f"v{v} {s:.1%}" for v, s in validation.items())


def report(results: dict[tuple[int, str], dict], seeds: list[int]) -> None:
    """Per seed and setting the table's row, then on less off per validation point."""
    print("seed setting | validation success | zero-advantage groups trained | dropped | episodes | steps s | wall s")
    for seed in seeds:
        for setting in SETTINGS:
            r = results[(seed, setting)]
            trained = len(r["uniform"]) * r["groups_per_step"]
            print(
                f"{seed} {setting:3} | {fmt_points(r['validation_success'])} | {sum(r['uniform'])} of {trained} | "
                f"{sum(r['dropped'])} | {sum(r['episodes'])} | {sum(r['seconds']):.0f} | {r['wall_seconds']:.0f}"
                + final_by_distance(r)
                + (f" | {r['failed'][:80]}" if r["failed"] else "")
            )
    points = sorted({v for r in results.values() for v in r["validation_success"]}, key=int)
    for v in points:
        both = [s for s in seeds if all(v in results[(s, k)]["validation_success"] for k in SETTINGS)]
        if not both:
            continue
        at = {k: [results[(s, k)]["validation_success"][v] for s in both] for k in SETTINGS}
        gaps = " ".join(f"{on - off:+.1%}" for on, off in zip(at["on"], at["off"]))
        print(
            f"v{v} ({len(both)} seeds): off {mean(at['off']):.1%}, on {mean(at['on']):.1%}; on - off per seed {gaps}; "
            f"episodes played before it: off {mean(episodes_before(results[(s, 'off')], v) for s in both):.0f}, "
            f"on {mean(episodes_before(results[(s, 'on')], v) for s in both):.0f}"
        )


def final_by_distance(result: dict) -> str:
    points = result["validation_by_distance"]
    if not points:
        return ""
    last = max(points, key=int)
    return f" | v{last} by distance: " + ", ".join(f"{d}: {s:.0%}" for d, s in points[last].items())


def episodes_before(result: dict, version: str) -> int:
    return sum(result["episodes"][: int(version)])


if __name__ == "__main__":
    sys.exit(main())
