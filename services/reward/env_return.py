from services.reward.base import RewardFunction


class EnvReturn(RewardFunction):
    """The environment's own return: the sum of its step rewards (a shaped env's shaping included)."""

    name = "env_return"

    def __call__(self, traj) -> float:
        return traj.env_return
