"""Crash-safe checkpoints of full (unsharded) model and optimizer state.

Layout: <dir>/step_<n>/{model.pt, optimizer.pt, [critic_model.pt, critic_optimizer.pt,] trainer_state.pt,
rng.pt, meta.json, COMMITTED}. Files are written into
`step_<n>.tmp`, which is renamed into place; the COMMITTED marker comes last, so a crash at any point
leaves every earlier checkpoint usable and this one ignored. Only rank 0 writes; the folder must be one
that rank 0 can see (all ranks read `latest_checkpoint`)."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from services.learner import fsdp

COMMITTED = "COMMITTED"
_STEP = re.compile(r"^step_(\d+)$")


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}"


def _committed(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir()
             if (m := _STEP.match(p.name)) and (p / COMMITTED).is_file()]
    return sorted(found)


def latest_checkpoint(directory: str | Path) -> Optional[Path]:
    found = _committed(Path(directory))
    return found[-1][1] if found else None


def prune(directory: str | Path, keep: int) -> None:
    """Keeps the `keep` newest committed checkpoints; removes older ones and unfinished leftovers up to
    the newest committed step."""
    directory = Path(directory)
    found = _committed(directory)
    if not found:
        return
    kept, newest = {p for _, p in found[-keep:]}, found[-1][0]
    for p in directory.iterdir():
        m = _STEP.match(p.name.removesuffix(".tmp").removesuffix(".old"))
        if m and p not in kept and int(m.group(1)) <= newest:
            shutil.rmtree(p, ignore_errors=True)


def _state_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(part: str) -> tuple[str, str]:
    """File names of one (model, optimizer) part; the policy keeps the plain names."""
    return ("model.pt", "optimizer.pt") if part == "policy" else (f"{part}_model.pt", f"{part}_optimizer.pt")


Parts = dict[str, tuple[nn.Module, torch.optim.Optimizer]]


def save(path: str | Path, parts: Parts, meta: dict[str, Any], keep: int,
         state: Optional[dict[str, Any]] = None) -> None:
    """Collective: every rank calls it; rank 0 writes. `parts` maps a name ("policy", "critic") to a
    sharded model and its optimizer; `state` (tensors, numbers, lists, dicts: schedulers, controllers)
    goes to trainer_state.pt; `meta` must be JSON-serialisable."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    path = Path(path)
    tensors: dict[str, Any] = {}
    for name, (model, optimizer) in parts.items():
        model_file, optim_file = _files(name)
        tensors[model_file] = fsdp.full_state_dict(model)
        tensors[optim_file] = get_optimizer_state_dict(model, optimizer, options=_state_options(cpu_offload=True))
    rng = fsdp.all_gather_object(_rng_state())
    if fsdp.is_rank0():
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for file, value in tensors.items():
            torch.save(value, tmp / file)
        torch.save(rng, tmp / "rng.pt")
        torch.save(state or {}, tmp / "trainer_state.pt")
        (tmp / "meta.json").write_text(json.dumps({**meta, "world_size": fsdp.world_size(),
                                                   "parts": sorted(parts)}))
        for f in tmp.iterdir():
            _fsync(f)
        old = path.with_name(path.name + ".old")
        if path.exists():  # saved again at the same step: move the earlier one aside until this one lands
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        (path / COMMITTED).write_text("ok\n")
        _fsync(path / COMMITTED)
        _fsync(path.parent)
        shutil.rmtree(old, ignore_errors=True)
        prune(path.parent, keep)
    fsdp.barrier()


def load(path: str | Path, parts: Parts) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective. Rank 0 reads the files and broadcasts the weights; returns (meta, state). RNG state is
    restored per rank when the world size matches the saving run's."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    path = Path(path)
    if not (path / COMMITTED).is_file():
        raise FileNotFoundError(f"{path}: not a committed checkpoint")
    meta = json.loads((path / "meta.json").read_text())
    missing = set(parts) - set(meta.get("parts", ["policy"]))
    if missing:
        raise ValueError(f"{path}: holds no {', '.join(sorted(missing))} (saved: {meta.get('parts', ['policy'])}); "
                         "the checkpoint comes from a run with another algorithm")
    rank0 = fsdp.is_rank0()
    for name, (model, optimizer) in parts.items():
        model_file, optim_file = _files(name)
        model_state = torch.load(path / model_file, map_location="cpu", weights_only=True) if rank0 else {}
        set_model_state_dict(model, model_state, options=_state_options(broadcast_from_rank0=True))
        del model_state
        optim_state = torch.load(path / optim_file, map_location="cpu", weights_only=True) if rank0 else {}
        set_optimizer_state_dict(model, optimizer, optim_state, options=_state_options(broadcast_from_rank0=True))
    state_file = path / "trainer_state.pt"
    state = torch.load(state_file, weights_only=True) if state_file.is_file() else {}
    if meta.get("world_size") == fsdp.world_size():
        _set_rng_state(torch.load(path / "rng.pt", weights_only=True)[fsdp.rank()])
    return meta, state
