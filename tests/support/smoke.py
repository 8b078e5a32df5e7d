"""Learner smoke run: a tiny random Llama, synthetic multi-turn trajectories, a few train steps, and a
checkpoint round trip; prints/writes losses and a parameter checksum as JSON. Checks a machine's
torch.distributed / FSDP setup, and lets tests compare 1 process with N:

    torchrun --nproc_per_node 2 -m tests.support.smoke --out result.json
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

ALL_AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
PPO_CASE = "ppo"
"""A case beside the aggregation modes: GAE with a critic, KL in the reward and as a loss, entropy bonus."""
PPO_SETTINGS = {
    "advantage": "gae",
    "lam": 0.9,
    "critic_lr": 1e-2,
    "use_kl_in_reward": True,
    "kl_ctrl": "adaptive",
    "use_kl_loss": True,
    "kl_loss_coef": 0.1,
    "entropy_coeff": 0.01,
    "lr_warmup_steps": 1,
}
LEVERS_CASE = "levers"
"""The PPO case with every scale lever on: mini-batches (one of a single sequence), packed micro-batches formed
by a token budget, activation checkpointing and chunked logprobs whose chunks do not divide the token count."""
LEVERS_SETTINGS = {**PPO_SETTINGS, "ppo_mini_batch_size": 3, "micro_batch_tokens": 24}
LEVERS_LEARNER = {"activation_checkpointing": True, "logprob_chunk_tokens": 5, "pack_sequences": True}
REJECT_CASE = "reject"
"""A case whose rollout correction rejects: the synthetic rollout logprobs (uniform in [-5, -0.5]) are far from the
random model's (about -log 64), so some sequences leave the geometric band [0.2, 5], others hold a token below the
veto. Two mini-batches, so that each has its own kept-token and kept-sequence divisors; entropy bonus on, so that
it aggregates over the kept tokens too."""
REJECT_SETTINGS = {
    "loss_agg_mode": "seq-mean-token-mean",
    "tis_cap": 5.0,
    "rollout_is_level": "geometric",
    "rollout_is_mode": "mask",
    "rollout_is_veto_threshold": 0.03,
    "ppo_mini_batch_size": 4,
    "entropy_coeff": 0.01,
}


def build_tiny_llama(path: str | Path, *, seed: int = 0, vocab_size: int = 64, tie: bool = False) -> Path:
    """A Llama smaller than the demo policy's (services.common.tiny_model) and without a tokenizer: its
    `vocab_size` ids are what `synthetic_trajectories` draws from."""
    from transformers import LlamaConfig

    from services.common.tiny_model import build_random_model

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return build_random_model(path, config, seed=seed)


def synthetic_trajectories(
    num: int, group_size: int, *, vocab_size: int = 64, seed: int = 0, policy_version: int = 0
) -> list:
    """Multi-turn episodes of random lengths; consecutive episodes share a group (the last may be short)."""
    from services.common.trajectory import TrajectoryBuilder

    rng = random.Random(seed)
    out = []
    for i in range(num):
        b = TrajectoryBuilder(
            env="smoke",
            task_index=i // group_size,
            group_id=f"g{i // group_size}",
            prompt_ids=[rng.randrange(3, vocab_size) for _ in range(rng.randint(2, 6))],
        )
        for turn in range(rng.randint(1, 3)):
            ids = [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 5))]
            b.add_model_turn(
                ids,
                [-rng.uniform(0.5, 5.0) for _ in ids],
                policy_version=policy_version + turn,
                text="",
                action="",
                action_valid=True,
                finish_reason="stop",
            )
            b.add_observation([rng.randrange(3, vocab_size) for _ in range(rng.randint(0, 4))], env_reward=0.0)
        traj = b.finish(env_return=0.0, success=rng.random() < 0.5, stop_reason="done")
        traj.reward = rng.uniform(-1.0, 1.0)
        out.append(traj)
    return out


def param_checksum(trainer) -> float:
    """Sum of |w| over the full weights (rank 0; 0.0 elsewhere)."""
    return float(sum(t.double().abs().sum() for _, t in trainer.named_weights_for_push()))


def streamed_push_agrees(trainer) -> bool:
    """Whether the bucketed push set (gathered tensor by tensor, small buckets) has the checksum of the
    full state dict. Collective; True on the ranks that only walk it."""
    from services.learner import collectives, full_weights
    from services.weightsync.wire import checksum

    full = trainer.named_weights_for_push()
    weights = trainer.weight_set_for_push()
    if not collectives.is_rank0():
        full_weights.walk_for_push(weights)
        return True
    for _ in weights.buckets(bucket_bytes=1 << 16):
        pass
    return weights.checksum == checksum(full)


def case_config(
    mode: str,
    *,
    group_size: int = 2,
    micro_batch_size: int = 3,
    ppo_epochs: int = 2,
    device: str = "cpu",
    dtype: str = "float32",
):
    """The learner config of one smoke case (an aggregation mode, `ppo`, `levers` or `reject`)."""
    from services.common.config import TrainConfig

    cases = {PPO_CASE: PPO_SETTINGS, LEVERS_CASE: LEVERS_SETTINGS, REJECT_CASE: REJECT_SETTINGS}
    extra = cases.get(mode, {"loss_agg_mode": mode})
    learner = LEVERS_LEARNER if mode == LEVERS_CASE else {}
    return TrainConfig.model_validate(
        {
            "rollout": {"group_size": group_size},
            "learner": {"device": device, **learner},
            "model": {"dtype": dtype},
            "algorithm": {
                "micro_batch_size": micro_batch_size,
                "ppo_epochs": ppo_epochs,
                "lr": 1e-2,
                "clip_ratio_low": 0.1,
                "clip_ratio_high": 0.15,
                **extra,
            },
        }
    )


def run(
    model_path: str,
    *,
    agg_modes: list[str],
    steps: int = 2,
    num: int = 7,
    group_size: int = 2,
    micro_batch_size: int = 3,
    ppo_epochs: int = 2,
    checkpoint_dir: str | None = None,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict[str, Any]:
    from services.learner.trainer import PolicyTrainer

    results: dict[str, Any] = {}
    for mode in agg_modes:
        config = case_config(
            mode,
            group_size=group_size,
            micro_batch_size=micro_batch_size,
            ppo_epochs=ppo_epochs,
            device=device,
            dtype=dtype,
        )
        trainer = PolicyTrainer(config, model_path)
        metrics = [trainer.train_step(synthetic_trajectories(num, group_size, seed=s)) for s in range(steps)]
        results[mode] = {
            "metrics": metrics,
            "checksum": param_checksum(trainer),
            "streamed_push_agrees": streamed_push_agrees(trainer),
        }
        if checkpoint_dir:
            trainer.policy_version = steps
            path = trainer.save_checkpoint(Path(checkpoint_dir) / mode, {"mode": mode})
            again = trainer.train_step(synthetic_trajectories(num, group_size, seed=steps))
            fresh = PolicyTrainer(config, model_path)
            extra = fresh.load_checkpoint(path)
            loaded = {"version": fresh.policy_version, "step": fresh.step}
            resumed = fresh.train_step(synthetic_trajectories(num, group_size, seed=steps))
            results[mode]["resume"] = {
                "extra": extra,
                **loaded,
                "continued": again,
                "resumed": resumed,
                "checksums": [param_checksum(trainer), param_checksum(fresh)],
            }
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: build a tiny random Llama)")
    parser.add_argument("--out", help="write the JSON result here (rank 0)")
    parser.add_argument(
        "--agg-modes",
        default=",".join(ALL_AGG_MODES),
        help=f"comma-separated aggregation modes, and/or `{PPO_CASE}` (critic + KL terms), "
        f"`{LEVERS_CASE}` (the same with the scale levers on), `{REJECT_CASE}` (a rollout correction that rejects)",
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--checkpoint-dir", help="also check a save/load round trip under this folder")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)

    from services.learner import collectives

    collectives.init_distributed(collectives.resolve_device(args.device))
    model = args.model
    if not model:
        model = collectives.broadcast_object(
            str(build_tiny_llama(tempfile.mkdtemp())) if collectives.is_rank0() else None
        )
    result = run(
        model,
        agg_modes=args.agg_modes.split(","),
        steps=args.steps,
        checkpoint_dir=args.checkpoint_dir,
        device=args.device,
        dtype=args.dtype,
    )
    if collectives.is_rank0():
        text = json.dumps({"world_size": collectives.world_size(), "results": result}, indent=1)
        if args.out:
            Path(args.out).write_text(text)
        else:
            print(text)


if __name__ == "__main__":
    main()
