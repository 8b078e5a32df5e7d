"""The learner config that trainer tests compare runs under, step metrics without their timings, and the
good-or-bad-token episodes that trainer tests teach a tiny policy on."""

from services.common.config import TrainConfig
from services.common.trajectory import TrajectoryBuilder

LEARNING_TASK = ["env.name=corridor", 'env.options={"max_turns": 3}']
"""The learning tests' task: corridor, 3 moves for distance 3 (1/8 by chance); `learning_tiny_model` is warm-started
on it."""

PROMPT = [5, 6, 7]
GOOD, BAD = 10, 20
"""The answers of `episode`: `good_bad_batch` rewards GOOD after PROMPT and not BAD."""


def untimed(metrics):
    """Metrics without the wall-clock phase timings, which differ from run to run."""
    return {k: v for k, v in metrics.items() if not k.startswith("time/")}


def make_config(learner=None, **algorithm):
    """A CPU learner, seed 1, groups of 4; `learner` and `algorithm` settings on top."""
    return TrainConfig.model_validate(
        {
            "seed": 1,
            "rollout": {"group_size": 4},
            "learner": {"device": "cpu", **(learner or {})},
            "algorithm": {"lr": 3e-3, "micro_batch_size": 3, "entropy_coeff": 0.01, **algorithm},
        }
    )


def episode(group, token, reward, logprob=-1.0):
    """One model turn after PROMPT: `token`, then token 3, each sampled at `logprob`; `reward` (a success if
    positive) in group `group`."""
    b = TrajectoryBuilder(env="t", task_index=0, group_id=group, prompt_ids=PROMPT)
    b.add_model_turn(
        [token, 3], [logprob, logprob], policy_version=0, text="", action="", action_valid=True, finish_reason="stop"
    )
    traj = b.finish(env_return=reward, success=reward > 0, stop_reason="done")
    traj.reward = reward
    return traj


def good_bad_batch():
    """Three groups of four episodes: GOOD rewarded 1 and BAD 0, twice each."""
    return [episode(f"g{g}", tok, r) for g in range(3) for tok, r in ((GOOD, 1.0), (BAD, 0.0)) * 2]


def logprob_of(trainer, token):
    """The trainer's policy's logprob of `token` after PROMPT."""
    import torch

    from services.learner.model import token_logprobs

    ids = torch.tensor([PROMPT + [token]])
    with torch.no_grad():
        return token_logprobs(trainer.model, ids, torch.ones_like(ids))[0, -1].item()


class Pieces:
    """A tokenizer stand-in for the synthetic ids (which have no tokenizer): id 7 reads `<7>`."""

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)

    def batch_decode(self, rows):
        return [self.decode(row) for row in rows]


def recording_config(tmp_path, episodes=-1, **algorithm):
    """The shared learner config, its run folder `tmp_path/run`, recording `episodes` per step (-1: all)."""
    config = make_config(**algorithm)
    config.learner.checkpoint_dir = str(tmp_path / "run" / "checkpoints")
    config.logging.episodes_per_step = episodes
    return config
