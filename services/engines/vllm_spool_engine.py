"""A vLLM weight-transfer engine that loads verified buckets from a spool file on this host: the CPU
transport behind vLLM's own weight-update path (`start_weight_update`, `update_weights` per bucket,
`finish_weight_update`), registered in vLLM's `WeightTransferEngineFactory` as `omrl_spool`.

vLLM 0.32's engines do not run on CPU: `nccl` and `ipc` move CUDA tensors (`torch.cuda` streams, CUDA
IPC handles), and the base class's `update_weights` ends with `torch.accelerator.synchronize()`
(vllm/distributed/weight_transfer/base.py:502), which raises "Cannot access accelerator device when
none is available" on a CPU build. This engine keeps the base lifecycle (layerwise reload, as the NCCL
engine does), reads each bucket through a private memory map of the spool (no copy before the model's
own), and synchronizes only where an accelerator exists. The `nccl` push's engine (`vllm_nccl_engine`,
`omrl_nccl`) extends this one with receiving buckets by broadcast; a set it staged is loaded by this path.

Imported by the worker extension module, so the registration happens inside every vLLM worker before
the worker builds its engine (`Worker.load_model`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from services.engines.vllm_weights import refresh_output_heads
from services.weightsync.spool import mapped_bucket
from services.weightsync.wire import TensorSpec

BACKEND = "omrl_spool"


@dataclass
class SpoolInitInfo(WeightTransferInitInfo):
    pass


@dataclass
class SpoolUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: where it starts in the spool file and its tensors (`SpooledBucket.to_info`)."""

    path: str
    offset: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    sizes: list[int] = field(default_factory=list)

    def __post_init__(self):
        n = len(self.names)
        if not (len(self.dtype_names) == len(self.shapes) == len(self.sizes) == n):
            raise ValueError("names, dtype_names, shapes and sizes must have one entry per tensor")

    @property
    def specs(self) -> list[TensorSpec]:
        return [
            TensorSpec(n, d, tuple(s), b) for n, d, s, b in zip(self.names, self.dtype_names, self.shapes, self.sizes)
        ]


class SpoolWeightTransferEngine(WeightTransferEngine[SpoolInitInfo, SpoolUpdateInfo]):
    init_info_cls = SpoolInitInfo
    update_info_cls = SpoolUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: SpoolInitInfo) -> None:
        pass  # nothing to rendezvous with: the buckets are in a file on this host

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.current_accelerator() is not None:
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: SpoolUpdateInfo) -> None:
        with mapped_bucket(update_info.path, update_info.offset, update_info.specs) as tensors:
            self.model.load_weights(tensors)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_output_heads(self.model)

    def shutdown(self) -> None:
        pass


def register() -> None:
    if BACKEND not in WeightTransferEngineFactory._registry:  # one registration per process
        WeightTransferEngineFactory.register_engine(BACKEND, SpoolWeightTransferEngine)
