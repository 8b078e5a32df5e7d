"""The pieces of `deterministic: true` that need no process: the batch order, the settings it refuses, and the vLLM
environment it implies."""

import random
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from services.common.config import load_config
from services.engines.vllm import engine_environment
from services.learner.determinism import canonical_order


def test_groups_train_in_slot_order_whatever_order_they_arrived_in():
    published = [SimpleNamespace(group_id=f"g{slot}", episode=i) for slot in (0, 2, 10, 11) for i in range(3)]
    arrived = [t for slot in (11, 0, 10, 2) for t in published if t.group_id == f"g{slot}"]
    assert canonical_order(arrived) == published  # g2 before g10: by number, not by name


def test_a_group_keeps_its_own_episode_order_and_other_ids_follow_the_slots():
    rng = random.Random(0)
    batch = [SimpleNamespace(group_id=g, episode=i) for g in ("resume-b", "g3", "resume-a") for i in range(4)]
    for _ in range(5):
        groups = ["resume-b", "g3", "resume-a"]
        rng.shuffle(groups)
        arrived = [t for g in groups for t in batch if t.group_id == g]
        ordered = canonical_order(arrived)
        assert [t.group_id for t in ordered[::4]] == ["g3", "resume-a", "resume-b"]
        assert [t.episode for t in ordered] == [0, 1, 2, 3] * 3


@pytest.mark.parametrize(
    ("setting", "named"),
    [("algorithm.max_staleness=1", "algorithm.max_staleness > 0"), ("algorithm.dynamic_sampling=true", "dynamic")],
)
def test_deterministic_refuses_what_lets_timing_pick_the_batch(setting, named):
    load_config(None, [setting])  # fine without it
    with pytest.raises(ValidationError, match=named) as info:
        load_config(None, ["deterministic=true", setting])
    assert "which rollouts finish first" in str(info.value)


def test_deterministic_asks_vllm_for_batch_invariant_kernels_on_a_gpu_only():
    assert engine_environment(deterministic=True, on_cpu=False) == {"VLLM_BATCH_INVARIANT": "1"}
    assert engine_environment(deterministic=True, on_cpu=True) == {}
    assert engine_environment(deterministic=False, on_cpu=False) == {}
