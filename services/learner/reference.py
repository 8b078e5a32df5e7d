"""The frozen reference policy for the KL terms: the run's initial weights, sharded like the policy."""

from __future__ import annotations

from typing import Any

import torch

from services.learner import collectives
from services.learner.model import load_model, token_logprobs
from services.learner.parallelize import parallelize
from services.learner.sequence_parallel import SequenceGroup


class ReferencePolicy:
    def __init__(
        self,
        model_path: str,
        dtype: str,
        device: torch.device,
        mixed_precision_bf16: bool,
        chunk_tokens: int = 0,
        pack: bool = False,
        attention: str = "sdpa",
        head: str = "fused",
        wrap: str = "layers",
        head_kernel: str = "auto",
        sequence_group: SequenceGroup | None = None,
    ):
        from services.weightsync.wire import checksum

        self.model = load_model(model_path, dtype, attention, head, head_kernel, split=sequence_group is not None)
        self.chunk_tokens, self.pack = chunk_tokens, pack
        self.model.requires_grad_(False)
        digest = checksum(self.model.state_dict().items()) if collectives.is_rank0() else None
        self.identity: dict[str, Any] = {"path": str(model_path), "checksum": collectives.broadcast_object(digest)}
        """Where the weights came from and their checksum; checkpoints record it, resume checks it."""
        parallelize(
            self.model, device, mixed_precision_bf16=mixed_precision_bf16, wrap=wrap, sequence_group=sequence_group
        )

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prefixes=None) -> torch.Tensor:
        return token_logprobs(self.model, input_ids, attention_mask, self.chunk_tokens, self.pack, prefixes)

    def check(self, saved: dict[str, Any]) -> None:
        """Refuses to resume against other reference weights than the checkpointed run used."""
        if saved and saved.get("checksum") != self.identity["checksum"]:
            raise ValueError(
                f"reference model changed since the checkpoint: it was {saved.get('path')} "
                f"(checksum {str(saved.get('checksum'))[:12]}), now {self.identity['path']} "
                f"(checksum {self.identity['checksum'][:12]})"
            )
