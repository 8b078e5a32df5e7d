"""The learner's process group and its collectives: joining the torchrun world (or making a world of one
without torchrun), rank and size, barrier, object broadcast and gather, tensor sum. On a world of one each
collective returns its input. FSDP sharding is `parallelize.py`'s, the full weights `full_weights.py`'s."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` picks CUDA when present; on CUDA each process takes the GPU of its LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device(name)


def init_distributed(device: torch.device | str) -> tuple[int, int]:
    """Joins the torchrun world (RANK/WORLD_SIZE/MASTER_* env vars), or else makes a world of one on an
    in-process store. gloo on CPU, nccl on CUDA. Idempotent; returns (rank, world_size)."""
    if not dist.is_initialized():
        device = torch.device(device)
        cuda = device.type == "cuda"
        kw: dict[str, Any] = {"backend": "nccl" if cuda else "gloo", "device_id": device if cuda else None}
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(**kw)
        else:
            dist.init_process_group(**kw, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_rank0() -> bool:
    return rank() == 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Every rank gets rank `src`'s object (picklable)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's object, in rank order, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """In place over `group` (None: the world)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor
