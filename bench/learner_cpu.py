"""The learner's CPU update on the vs_trl batch, against a plain PyTorch/Hugging Face loop on the same tensors,
in one process: where does the project's `train_step` lose to TRL's trainer?

The batch is vs_trl's: 4 prompts x 8 generations, the corridor one-turn prompt (chat template) and 16 sampled
tokens; the config is vs_trl's project side (configs/tiny_model_rl.yaml + its overrides: GRPO, one epoch, no
entropy bonus; `--recipe` as vs_trl's: like-for-like has no KL term, `project` a KL loss against the reference).
The sides alternate step by step:

  project  `PolicyTrainer.train_step` (the reference pass with KL, fused scoring, FSDP on one process, chunked head)
  shared   the same with `learner.share_prefix` (each group's prompt computed once, services/learner/prefix.py)
  bare     what TRL's GRPOTrainer computes per step, written plainly: with KL the reference's forward under no_grad;
           the policy's forward (dense logits, log-softmax gather), the clipped loss (+ k3 KL), backward, grad clip,
           AdamW (foreach) step; plain `nn.Module`s, no FSDP

Per step: wall seconds of the scoring (reference) pass, the update and the whole step, and the process's CPU
seconds (all threads), which on a shared, loaded machine says more than the wall time. Threads: run it with the
environment the launcher gives the learner (`--threads N` sets torch's threads; OMP_* variables are read at
import, so set them outside, e.g. `OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE`).

    python bench/learner_cpu.py --model-dir runs/bench-vs-trl/model-85m/base --steps 3
    python bench/learner_cpu.py --model-dir ... --sides project,shared   # learner.share_prefix off / on
    python bench/learner_cpu.py --model-dir ... --profile          # + torch.profiler top ops of one step each
    python bench/learner_cpu.py --model-dir ... --set learner.fsdp_wrap=layers   # a project override
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.result_path import result_path  # noqa: E402
from bench.vs_trl import CONFIG, OPTIONS  # noqa: E402


def batch(model_dir: str, prompts: int, generations: int, new_tokens: int, seed: int = 0) -> list:
    from transformers import AutoTokenizer

    from services.common.trajectory import TrajectoryBuilder
    from services.envs.builtin.corridor import Corridor

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    out = []
    for task in range(prompts):
        obs = Corridor().reset(task, OPTIONS)
        ids = tok.apply_chat_template([{"role": "user", "content": obs}], tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        for g in range(generations):
            b = TrajectoryBuilder(env="corridor", task_index=task, group_id=f"g{task}", prompt_ids=ids)
            b.add_model_turn(
                [rng.randrange(4, len(tok)) for _ in range(new_tokens)],
                [-rng.uniform(4.0, 8.0) for _ in range(new_tokens)],
                policy_version=0,
                text="",
                action="",
                action_valid=False,
                finish_reason="length",
            )
            traj = b.finish(env_return=0.0, success=False, stop_reason="max_turns")
            traj.reward = float(g % 2)  # non-zero advantages: the update has work to do
            out.append(traj)
    return out


class Bare:
    """TRL's per-step computation on plain modules (fp32, sdpa, dense logits)."""

    def __init__(self, model_dir: str, lr: float, beta: float, eps_low: float, eps_high: float, grad_clip: float):
        import torch
        from transformers import AutoModelForCausalLM

        self.policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().requires_grad_(False)
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=lr)
        self.beta, self.eps_low, self.eps_high, self.grad_clip = beta, eps_low, eps_high, grad_clip

    @staticmethod
    def _logprobs(model, ids, mask):
        import torch

        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    def step(self, tb) -> dict[str, float]:
        import torch

        ids, mask, resp = tb.input_ids, tb.attention_mask, tb.response_mask[:, 1:]
        rewards = tb.rewards.view(-1, 8)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1, 1)
        t0 = time.perf_counter()
        if self.beta:
            with torch.no_grad():
                ref = self._logprobs(self.ref, ids, mask)
        t1 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        lp = self._logprobs(self.policy, ids, mask)
        ratio = torch.exp(lp - lp.detach())
        pg = -torch.min(ratio * adv, ratio.clamp(1 - self.eps_low, 1 + self.eps_high) * adv)
        if self.beta:
            pg = pg + self.beta * (torch.exp(ref - lp) - (ref - lp) - 1)
        loss = (pg * resp).sum() / resp.sum()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.grad_clip)
        self.opt.step()
        t2 = time.perf_counter()
        return {"score_s": t1 - t0, "update_s": t2 - t1, "step_s": t2 - t0, "grad_norm": float(norm)}


def project_runner(config, model_dir: str, trajs: list, share_prefix: bool):
    from services.learner.trainer import PolicyTrainer

    config = config.model_copy(deep=True)
    config.learner.share_prefix = share_prefix
    trainer = PolicyTrainer(config, model_dir)

    def run() -> dict[str, float]:
        start = time.perf_counter()
        m = trainer.train_step(trajs)
        return {
            "score_s": m["time/score_s"],
            "update_s": m["time/policy_update_s"],
            "step_s": time.perf_counter() - start,
            "grad_norm": m["grad_norm"],
        }

    return run


def top_ops(fn, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per side (after one untimed warm-up each)")
    ap.add_argument("--sides", default="project,bare")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra project override")
    ap.add_argument(
        "--recipe",
        choices=["like-for-like", "project"],
        default="like-for-like",
        help="vs_trl's recipe: like-for-like (no KL: no reference pass on either side) or the project's",
    )
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of one step per side")
    ap.add_argument("--out")
    args = ap.parse_args()

    import torch

    from bench.vs_trl import overrides
    from services.common.config import load_config
    from services.learner.batch import collate

    if args.threads:
        torch.set_num_threads(args.threads)
    ns = argparse.Namespace(
        prompts=args.prompts, generations=args.generations, steps=8, set=args.set, recipe=args.recipe
    )
    config = load_config(str(CONFIG), [*overrides(ns), f"model.path={args.model_dir}", "learner.device=cpu"])
    trajs = batch(args.model_dir, args.prompts, args.generations, args.new_tokens)
    sides = args.sides.split(",")
    runners = {}
    for side in ("project", "shared"):
        if side in sides:
            runners[side] = project_runner(config, args.model_dir, trajs, share_prefix=side == "shared")
    if "bare" in sides:
        a = config.algorithm
        beta = a.kl_loss_coef if a.use_kl_loss else 0.0
        bare = Bare(args.model_dir, a.lr, beta, a.clip_ratio_low, a.clip_ratio_high, a.grad_clip)
        tb = collate(trajs, int(bare.policy.config.pad_token_id or 0))
        runners["bare"] = lambda: bare.step(tb)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {len(trajs)} x "
        f"{len(trajs[0].token_ids)} tokens ({trajs[0].prompt_length} prompt)",
        flush=True,
    )
    times: dict[str, list[dict]] = {s: [] for s in runners}
    for i in range(args.steps + 1):
        for side, run in runners.items():
            cpu = time.process_time()
            t = run()
            t["cpu_s"] = time.process_time() - cpu  # every thread of the process: the work, whatever the load
            print(
                f"{side:8s} step {i}{' (warm-up)' if i == 0 else ''}: "
                + ", ".join(f"{k} {v:.3f}" for k, v in t.items()),
                flush=True,
            )
            if i:
                times[side].append(t)
    if args.profile:
        for side, run in runners.items():
            print(f"--- {side}: top ops by self CPU time ---\n{top_ops(run, 25)}", flush=True)
    summary = {s: {k: round(statistics.median(t[k] for t in ts), 3) for k in ts[0]} for s, ts in times.items()}
    for side, row in summary.items():
        print(f"median {side:8s} " + ", ".join(f"{k} {v}" for k, v in row.items()))
    for a, b in (("project", "bare"), ("shared", "project"), ("shared", "bare")):
        if a in summary and b in summary:
            for key in ("step_s", "cpu_s"):
                print(f"ratio {a}/{b} {key}: {summary[a][key] / summary[b][key]:.2f}")
    out = result_path(args.out, "learner_cpu")
    out.write_text(
        json.dumps(
            {"args": vars(args), "threads": torch.get_num_threads(), "median": summary, "steps": times}, indent=1
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
