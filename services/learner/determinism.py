"""What makes a learner step a function of its inputs: the batch in a fixed order, whatever order the rollouts
finished in, and (the `deterministic` setting) kernels that always reduce in the same order."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

_SLOT = re.compile(r"^g(\d+)$")


def group_key(group_id: str) -> tuple[int, int, str]:
    """Producers name a group after its slot (`g12`): slots in number order, any other id after them by name."""
    found = _SLOT.match(group_id)
    return (0, int(found.group(1)), "") if found else (1, 0, group_id)


def canonical_order(trajectories: Sequence[T]) -> list[T]:
    """The batch's groups in slot order, each group's episodes in the order its producer published them.
    Groups reach the stream in the order they finish, which varies from run to run; the sums of the update
    (losses, gradients) depend on the order of their terms in the last bits, and those bits decide later samples."""
    return sorted(trajectories, key=lambda t: group_key(t.group_id))  # stable: a group's own order is kept


def use_deterministic_kernels(device_type: str) -> None:
    """torch picks kernels that reduce in a fixed order (and fails on an op that has none, rather than vary);
    cuBLAS needs a fixed workspace for that, set before its first call."""
    import torch

    if device_type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)
