from typing import Annotated

from pydantic import Field

from services.reward.base import RewardFunction

PositiveInt = Annotated[int, Field(gt=0)]


class OverlongPenalty(RewardFunction):
    """DAPO's soft overlong punishment (verl's `overlong_buffer`): 0 up to max_response_length -
    overlong_buffer_len model tokens, then linear down to -1 at max_response_length, -1 beyond it.
    The component's weight plays verl's `overlong_buffer.penalty_factor`."""

    name = "overlong_penalty"

    def __init__(self, max_response_length: PositiveInt, overlong_buffer_len: PositiveInt):
        for param, value in (
            ("max_response_length", max_response_length),
            ("overlong_buffer_len", overlong_buffer_len),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{param} must be a positive int, got {value!r}")
        if overlong_buffer_len > max_response_length:
            raise ValueError(
                f"overlong_buffer_len {overlong_buffer_len} exceeds max_response_length {max_response_length}"
            )
        self.max_response_length, self.overlong_buffer_len = max_response_length, overlong_buffer_len

    def __call__(self, traj) -> float:
        expected = self.max_response_length - self.overlong_buffer_len
        excess = max(0, sum(turn.model_tokens for turn in traj.turns) - expected)
        return max(-1.0, -excess / self.overlong_buffer_len)
