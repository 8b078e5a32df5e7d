from services.reward.base import RewardFunction


class InvalidToolCalls(RewardFunction):
    """Minus the episode's invalid tool calls (unparsed, an unknown tool, arguments failing the schema, over the
    turn's limit: `Turn.invalid_tool_calls`), at most `cap` of them: a penalty with a negative-free weight, e.g.
    `invalid_tool_calls: {weight: 0.1}` costs 0.1 a bad call. 0 for an episode without tools."""

    name = "invalid_tool_calls"

    def __init__(self, cap: int = 10):
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"cap must be an int >= 1, got {cap!r}")
        self.cap = cap

    def __call__(self, traj) -> float:
        return -float(min(sum(turn.invalid_tool_calls for turn in traj.turns), self.cap))
