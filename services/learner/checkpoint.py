"""Crash-safe checkpoints of model and optimizer state, in one of two formats.

- `sharded` (torch.distributed.checkpoint): every rank writes its own shards (`__<rank>_0.distcp`, plus
  `.metadata`) into `<dir>/step_<n>/`; loading reshards, so a checkpoint resumes on another number of
  processes. The folder must be shared by all ranks (one PersistentVolume, or a local disk for one node).
  Optionally asynchronous: the shards are staged in memory and written by a background thread while
  training goes on; `PendingCheckpoint.commit()` waits for them and commits.
- `full`: rank 0 writes `model.pt`, `optimizer.pt` (and `critic_*.pt`) as unsharded state dicts.

Both also hold trainer_state.pt, rng.pt, meta.json (with `format`) and COMMITTED. Files are written into
`step_<n>.tmp`, renamed into place, and the COMMITTED marker comes last, so a crash at any point leaves
every earlier checkpoint usable and this one ignored. `load` reads either format, whatever the config
says now."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from services.learner import collectives, full_weights

COMMITTED = "COMMITTED"
_STEP = re.compile(r"^step_(\d+)$")


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}"


def _committed(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP.match(p.name)) and (p / COMMITTED).is_file()
    ]
    return sorted(found)


def latest_checkpoint(directory: str | Path) -> Path | None:
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
FORMATS = ("sharded", "full")
_SHARDS = "shards"


class PendingCheckpoint:
    """A checkpoint whose tensors are written (or being written, when asynchronous); `commit()` waits for
    them, then writes the small files and the COMMITTED marker. Collective: every rank calls `commit`."""

    def __init__(
        self, path: Path, tmp: Path, files: dict[str, Any], meta: dict[str, Any], keep: int, future: Any = None
    ):
        self.path, self.tmp, self.files, self.meta, self.keep, self.future = path, tmp, files, meta, keep, future
        self.committed = False

    def commit(self) -> Path:
        if self.committed:
            return self.path
        if self.future is not None:
            self.future.result()
            self.future = None
        collectives.barrier()
        if collectives.is_rank0():
            for file, value in self.files.items():
                torch.save(value, self.tmp / file)
            (self.tmp / "meta.json").write_text(json.dumps(self.meta))
            for f in self.tmp.rglob("*"):
                if f.is_file():
                    _fsync(f)
            old = self.path.with_name(self.path.name + ".old")
            if self.path.exists():  # saved again at the same step: move the earlier one aside until this one lands
                shutil.rmtree(old, ignore_errors=True)
                os.replace(self.path, old)
            os.replace(self.tmp, self.path)
            (self.path / COMMITTED).write_text("ok\n")
            _fsync(self.path / COMMITTED)
            _fsync(self.path.parent)
            shutil.rmtree(old, ignore_errors=True)
            prune(self.path.parent, self.keep)
        collectives.barrier()
        self.committed = True
        return self.path


_checkpoint_group: Any = None


def _background_group() -> Any:
    """A gloo group of its own for asynchronous saves, so their collectives never interleave with the
    training's on the default group."""
    global _checkpoint_group
    if _checkpoint_group is None:
        import torch.distributed as dist

        _checkpoint_group = dist.new_group(backend="gloo")
    return _checkpoint_group


def _sharded_state(parts: Parts) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = {}
    for name, (model, optimizer) in parts.items():
        model_state, optim_state = get_state_dict(model, optimizer)
        out[name] = {"model": model_state, "optim": optim_state}
    return out


def save(
    path: str | Path,
    parts: Parts,
    meta: dict[str, Any],
    keep: int,
    state: dict[str, Any] | None = None,
    fmt: str = "full",
    background: bool = False,
) -> PendingCheckpoint:
    """Collective: every rank calls it. `parts` maps a name ("policy", "critic") to a sharded model and
    its optimizer; `state` (tensors, numbers, lists, dicts: schedulers, controllers) goes to
    trainer_state.pt; `meta` must be JSON-serialisable. Returns the checkpoint for the caller to commit;
    with `background` (sharded only) its shards are still being written then."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if fmt not in FORMATS:
        raise ValueError(f"checkpoint format {fmt!r}: expected one of {', '.join(FORMATS)}")
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if collectives.is_rank0():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    collectives.barrier()
    files: dict[str, Any] = {}
    future = None
    if fmt == "full":
        for name, (model, optimizer) in parts.items():
            model_file, optim_file = _files(name)
            files[model_file] = full_weights.full_state_dict(model)
            files[optim_file] = get_optimizer_state_dict(model, optimizer, options=_state_options(cpu_offload=True))
    else:
        import torch.distributed.checkpoint as dcp

        shards = _sharded_state(parts)
        if background:
            future = dcp.async_save(shards, checkpoint_id=tmp / _SHARDS, process_group=_background_group())
        else:
            dcp.save(shards, checkpoint_id=tmp / _SHARDS)
    files["rng.pt"] = collectives.all_gather_object(_rng_state())
    files["trainer_state.pt"] = state or {}
    if not collectives.is_rank0():
        files = {}
    meta = {**meta, "world_size": collectives.world_size(), "parts": sorted(parts), "format": fmt}
    return PendingCheckpoint(path, tmp, files, meta, keep, future)


def _load_full(path: Path, parts: Parts) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    rank0 = collectives.is_rank0()
    for name, (model, optimizer) in parts.items():
        model_file, optim_file = _files(name)
        model_state = torch.load(path / model_file, map_location="cpu", weights_only=True) if rank0 else {}
        set_model_state_dict(model, model_state, options=_state_options(broadcast_from_rank0=True))
        del model_state
        optim_state = torch.load(path / optim_file, map_location="cpu", weights_only=True) if rank0 else {}
        set_optimizer_state_dict(model, optimizer, optim_state, options=_state_options(broadcast_from_rank0=True))


def _load_sharded(path: Path, parts: Parts) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    shards = _sharded_state(parts)
    dcp.load(shards, checkpoint_id=path / _SHARDS)
    for name, (model, optimizer) in parts.items():
        set_state_dict(model, optimizer, model_state_dict=shards[name]["model"], optim_state_dict=shards[name]["optim"])


def load(path: str | Path, parts: Parts) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective. Restores the parts from either format (a sharded one onto any number of processes);
    returns (meta, state). RNG state is restored per rank when the world size matches the saving run's."""
    path = Path(path)
    if not (path / COMMITTED).is_file():
        raise FileNotFoundError(f"{path}: not a committed checkpoint")
    meta = json.loads((path / "meta.json").read_text())
    missing = set(parts) - set(meta.get("parts", ["policy"]))
    if missing:
        raise ValueError(
            f"{path}: holds no {', '.join(sorted(missing))} (saved: {meta.get('parts', ['policy'])}); "
            "the checkpoint comes from a run with another algorithm"
        )
    if meta.get("format", "full") == "sharded":
        _load_sharded(path, parts)
    else:
        _load_full(path, parts)
    state_file = path / "trainer_state.pt"
    state = torch.load(state_file, weights_only=True) if state_file.is_file() else {}
    if meta.get("world_size") == collectives.world_size():
        _set_rng_state(torch.load(path / "rng.pt", weights_only=True)[collectives.rank()])
    return meta, state


def full_model_state(path: str | Path, part: str = "policy") -> dict[str, torch.Tensor]:
    """One part's unsharded weights from a committed checkpoint of either format, in this process, with
    no process group (export, inspection, tests)."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("format", "full") != "sharded":
        return torch.load(path / _files(part)[0], map_location="cpu", weights_only=True)
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    everything: dict[str, Any] = {}
    _load_state_dict(
        everything,
        storage_reader=FileSystemReader(path / _SHARDS),
        planner=_EmptyStateDictLoadPlanner(keys={f"{part}.model"}),
        no_dist=True,
    )
    return dict(everything[part]["model"])
