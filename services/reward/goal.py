from services.reward.base import RewardFunction


class GoalReward(RewardFunction):
    """1 when the episode reached its goal, else 0."""

    name = "goal"

    def __call__(self, traj) -> float:
        return 1.0 if traj.success else 0.0
