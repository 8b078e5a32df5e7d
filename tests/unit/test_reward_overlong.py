"""DAPO's overlong reward shaping (services/reward/overlong_penalty.py) against a plain reference."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.reward.composer import RewardComposer
from services.reward.overlong_penalty import OverlongPenalty
from tests.support.service_fakes import trajectory


def reference(length: int, max_len: int, buffer: int) -> float:
    """DAPO's R_length: 0 within L_max - L_cache, -1 past L_max, linear between."""
    if length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return ((max_len - buffer) - length) / buffer
    return -1.0


@st.composite
def cases(draw):
    max_len = draw(st.integers(1, 400))
    buffer = draw(st.integers(1, max_len))
    turns = draw(st.lists(st.integers(1, 200), max_size=5))
    return max_len, buffer, turns


@given(cases())
def test_matches_the_reference_over_the_model_tokens_of_every_turn(case):
    max_len, buffer, turns = case
    penalty = OverlongPenalty(max_response_length=max_len, overlong_buffer_len=buffer)
    value = penalty(trajectory(*[(n, True) for n in turns]))
    assert value == pytest.approx(reference(sum(turns), max_len, buffer), abs=1e-12)
    assert -1.0 <= value <= 0.0


@given(cases())
def test_never_rises_with_length(case):
    max_len, buffer, turns = case
    penalty = OverlongPenalty(max_response_length=max_len, overlong_buffer_len=buffer)
    values = [penalty(trajectory((n, True))) for n in range(1, max_len + buffer + 2)]
    assert all(a >= b for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("tokens, expected", [(12, 0.0), (13, -0.25), (14, -0.5), (16, -1.0), (40, -1.0)])
def test_buffer_edges(tokens, expected):
    assert OverlongPenalty(max_response_length=16, overlong_buffer_len=4)(trajectory((tokens, True))) == expected


@pytest.mark.parametrize(
    "params, message",
    [
        ({"max_response_length": 0, "overlong_buffer_len": 1}, "max_response_length must be a positive int"),
        ({"max_response_length": 8, "overlong_buffer_len": True}, "overlong_buffer_len must be a positive int"),
        ({"max_response_length": 8.0, "overlong_buffer_len": 2}, "max_response_length must be a positive int"),
        ({"max_response_length": 8, "overlong_buffer_len": 9}, "overlong_buffer_len 9 exceeds max_response_length 8"),
    ],
)
def test_rejects_bad_params(params, message):
    with pytest.raises(ValueError, match=message):
        OverlongPenalty(**params)


def test_the_weight_is_the_penalty_factor():
    composer = RewardComposer(
        {"overlong_penalty": {"weight": 0.5, "params": {"max_response_length": 16, "overlong_buffer_len": 4}}}
    )
    total, parts, _ = composer.score(trajectory((14, True)))
    assert total == pytest.approx(-0.25) and parts == {"overlong_penalty": pytest.approx(-0.25)}
    with pytest.raises(ValueError, match="'overlong_penalty': bad params"):
        RewardComposer({"overlong_penalty": {"params": {"max_response_length": 16}}})
