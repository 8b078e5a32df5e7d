from services.reward.base import RewardFunction


class FormatReward(RewardFunction):
    """Share of turns whose action parsed (`action_valid`); 0 without turns."""

    name = "format"

    def __call__(self, traj) -> float:
        if not traj.turns:
            return 0.0
        return sum(turn.action_valid for turn in traj.turns) / len(traj.turns)
