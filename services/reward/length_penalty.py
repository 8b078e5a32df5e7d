from services.reward.base import RewardFunction


class LengthPenalty(RewardFunction):
    """-(model tokens beyond max_tokens) / max_tokens, clipped to [-1, 0]."""

    name = "length_penalty"

    def __init__(self, max_tokens: int):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        self.max_tokens = max_tokens

    def __call__(self, traj) -> float:
        excess = max(0, sum(turn.model_tokens for turn in traj.turns) - self.max_tokens)
        return max(-1.0, -excess / self.max_tokens)
