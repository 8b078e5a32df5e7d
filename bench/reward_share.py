"""What a reward model costs the local pipeline's step: the same short run (`python -m services.launcher train`,
one shared tiny model) with the recipe's rule rewards (`rules`), and with a reward model beside them asked once a
group (`rm_group`), the same with every token computed (`rm_unshared`, the model's `share_prefixes: false`), or as
each episode ends (`rm_episode`, `reward.score_each: episode`).

    nice python bench/reward_share.py --config configs/tiny_model_rl.yaml --steps 12 --runs 2 [--dtype bfloat16]

The reward model has the policy's shape and tokenizer and a fresh score head (its scores are noise), at weight 0:
every mode trains on the same rewards, so what differs between them is the reward model's time and CPU alone. Step
time is the learner's `step_seconds`, the median over steps 2..N of each run, then over runs; "step against rules"
is a mode's median step over the `rules` median, minus one. "Reward wait" is what the reward service adds to a
group (the rollout's `reward_wait` stage: from the end of the group's last episode to its last reward), the median
over steps 2..N of a step's mean per group, then over runs; its share is that over the mode's median step (the
learner waits for a step's last group, which waits this long after its play). Runs are interleaved (rules, rm_group,
rm_unshared, rm_episode, rules, ...) so a machine's drift falls on every mode alike. JSON goes to `--out` (default
bench/results/)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.local_step import build_model, run_once, write_summary  # noqa: E402

MODES = ("rules", "rm_group", "rm_unshared", "rm_episode")


def build_reward_model(policy: Path, out: Path) -> Path:
    """A one-label classifier of the policy's config and tokenizer, its weights drawn afresh (seed 0)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(policy)
    config.num_labels = 1
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(policy).save_pretrained(out)
    return out


def mode_overrides(config: str | None, sets: list[str], reward_model: Path, dtype: str) -> dict[str, list[str]]:
    """Each mode's overrides: the recipe's own reward components, plus the reward model at weight 0."""
    import services.plugins  # noqa: F401 - the reward registry, for the params' checks
    from services.common.config import load_config

    components = {name: c.model_dump() for name, c in load_config(config, sets).reward.components.items()}

    def scored(**params) -> str:
        model = {"weight": 0.0, "params": {"path": str(reward_model), "dtype": dtype, **params}}
        return f"reward.components={json.dumps({**components, 'reward_model': model})}"

    return {
        "rules": [],
        "rm_group": [scored(), "reward.score_each=group"],
        "rm_unshared": [scored(share_prefixes=False), "reward.score_each=group"],
        "rm_episode": [scored(), "reward.score_each=episode"],
    }


def group_wait(result: dict) -> float:
    """The median over a run's steps of the mean `reward_wait` per group."""
    rows = [r for r in result["stages_per_step"] if r.get("reward_wait_calls")]
    return statistics.median(r["reward_wait_s"] / r["reward_wait_calls"] for r in rows) if rows else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--runs", type=int, default=2, help="runs per mode, interleaved")
    parser.add_argument("--config", help="recipe (e.g. configs/tiny_model_rl.yaml); default: the built-in config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the reward model's")
    parser.add_argument("--work-dir", default=str(ROOT / "runs" / "bench-reward-share"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    runs_dir = Path(args.work_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(runs_dir, args.set, args.config)
    reward_model = build_reward_model(model, runs_dir / "reward_model")
    # what bench.local_step.run_once reads
    args.mode_sets = mode_overrides(args.config, args.set, reward_model, args.dtype)
    args.sample_s, args.scrape_s, args.success = 0.5, 0.25, 0.9
    results = [run_once(mode, i, args, model, runs_dir) for i in range(args.runs) for mode in MODES]
    medians = {mode: statistics.median(r["median_step_s"] for r in results if r["mode"] == mode) for mode in MODES}
    collect = {mode: statistics.median(r["median_collect_s"] for r in results if r["mode"] == mode) for mode in MODES}
    wait = {mode: statistics.median(group_wait(r) for r in results if r["mode"] == mode) for mode in MODES}
    for mode in MODES:
        share = medians[mode] / medians["rules"] - 1
        print(
            f"{mode:>10}: median step {medians[mode]:.3f} s, collect {collect[mode]:.3f} s, "
            f"step against rules {share:+.1%}, reward wait a group {wait[mode] * 1000:.0f} ms "
            f"({wait[mode] / medians[mode]:.1%} of the step)"
        )
    write_summary(
        "reward_share",
        args,
        results,
        reward_model_dtype=args.dtype,
        median_step_s=medians,
        median_collect_s=collect,
        median_reward_wait_s=wait,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
