"""The rollout server's side of an `nccl` push (the data comes by broadcast to the engine's workers, see
`services/common/weight_dist.py`): the same declaration rules as a gRPC push (`weight_receiver`), a
spool file whose bucket offsets this side chooses, and the set checksum over the declared digests.

The workers write each bucket into the spool only after its digest and finite values checked; the set
is applied from the spool at a commit that verifies, as for a gRPC push. Any refusal, or a stream that
ends without its commit, deletes the spool."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

from services.common.weight_dist import set_checksum
from services.common.weight_spool import PAGE, SpooledBucket, WeightSpool
from services.common.weights import TensorSpec, WeightSetRejected
from services.rollout.weight_receiver import check_declaration, check_header_sizes

_DIGEST = re.compile(r"(sha256:[0-9a-f]{64}|sum64:[0-9a-f]{48})")


class DistStaging:
    def __init__(self, specs: Sequence[TensorSpec], bucket_bytes: int, total_bytes: int, spool_dir: str | None = None):
        check_header_sizes(specs, bucket_bytes, total_bytes)
        self.specs, self.bucket_bytes = list(specs), bucket_bytes
        if spool_dir:
            Path(spool_dir).mkdir(parents=True, exist_ok=True)
        fd, self.path = tempfile.mkstemp(prefix="omrl-weights-", suffix=".spool", dir=spool_dir or None)
        os.close(fd)
        self.buckets: list[SpooledBucket] = []
        self.digests: list[str] = []
        self._next = 0
        self._end = 0

    def declare(self, specs: Sequence[TensorSpec], nbytes: int, digest: str) -> dict:
        """Checks a bucket's declaration; returns the engine's `update_info` that receives it."""
        expected = check_declaration(self.specs, self._next, specs, nbytes, self.bucket_bytes)
        if not _DIGEST.fullmatch(digest):
            raise WeightSetRejected("bucket digest is not sha256:<64 hex> or sum64:<48 hex>")
        offset = self._end + (-self._end % PAGE)
        bucket = SpooledBucket(offset, expected)
        self._next += len(expected)
        self._end = offset + nbytes
        self.buckets.append(bucket)
        self.digests.append(digest)
        return {**bucket.to_info(self.path), "kind": "receive", "digest": digest}

    def commit(self, checksum: str) -> WeightSpool:
        if self._next != len(self.specs):
            raise WeightSetRejected(f"push ended after {self._next} of {len(self.specs)} tensors")
        expected = set_checksum(self.specs, self.digests)
        if expected != checksum:
            raise WeightSetRejected(f"checksum {expected[:12]} != declared {checksum[:12]}")
        return WeightSpool(self.path, list(self.buckets))

    def abort(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
