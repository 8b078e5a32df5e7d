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
    """The server's record of an `nccl` push: declarations checked against the header, the spool's bucket
    offsets, the digests. With `digests_follow` a bucket is declared without its digest, which comes in a
    `bucket_digest` message before the next declaration or the commit; the worker checks a bucket only when
    the next one is declared (or at the flush), so each declaration hands it the previous bucket's digest."""

    def __init__(
        self,
        specs: Sequence[TensorSpec],
        bucket_bytes: int,
        total_bytes: int,
        spool_dir: str | None = None,
        *,
        digests_follow: bool = False,
    ):
        check_header_sizes(specs, bucket_bytes, total_bytes)
        self.specs, self.bucket_bytes, self.digests_follow = list(specs), bucket_bytes, digests_follow
        if spool_dir:
            Path(spool_dir).mkdir(parents=True, exist_ok=True)
        fd, self.path = tempfile.mkstemp(prefix="omrl-weights-", suffix=".spool", dir=spool_dir or None)
        os.close(fd)
        self.buckets: list[SpooledBucket] = []
        self.digests: list[str] = []
        self._next = 0
        self._end = 0

    def declare(self, specs: Sequence[TensorSpec], nbytes: int, digest: str) -> dict:
        """Checks a bucket's declaration; returns the engine's `update_info` that receives it (with
        `previous_digest`, the digest of the bucket before it, where digests follow)."""
        expected = check_declaration(self.specs, self._next, specs, nbytes, self.bucket_bytes)
        if self.digests_follow:
            if digest:
                raise WeightSetRejected("digests follow their buckets in this push: a declaration carries none")
            self._require_digests()
        elif not _DIGEST.fullmatch(digest):
            raise WeightSetRejected("bucket digest is not sha256:<64 hex> or sum64:<48 hex>")
        offset = self._end + (-self._end % PAGE)
        bucket = SpooledBucket(offset, expected)
        self._next += len(expected)
        self._end = offset + nbytes
        previous = self.digests[-1] if self.digests_follow and self.digests else ""
        self.buckets.append(bucket)
        if not self.digests_follow:
            self.digests.append(digest)
        return {**bucket.to_info(self.path), "kind": "receive", "digest": digest, "previous_digest": previous}

    def add_digest(self, digest: str) -> None:
        """The digest of the bucket declared last (a `digests_follow` push)."""
        if not self.digests_follow:
            raise WeightSetRejected("a bucket digest after its declaration, in a push whose declarations carry them")
        if len(self.digests) >= len(self.buckets):
            raise WeightSetRejected("a bucket digest with no bucket declared and awaiting it")
        if not _DIGEST.fullmatch(digest):
            raise WeightSetRejected("bucket digest is not sha256:<64 hex> or sum64:<48 hex>")
        self.digests.append(digest)

    def last_digest(self) -> str:
        """What the worker checks the last received bucket against at the flush ("" where declarations
        carried the digests)."""
        if not self.digests_follow or not self.buckets:
            return ""
        self._require_digests()
        return self.digests[-1]

    def _require_digests(self) -> None:
        if len(self.digests) < len(self.buckets):
            raise WeightSetRejected(f"the digest of bucket {len(self.digests)} did not follow it")

    def commit(self, checksum: str) -> WeightSpool:
        if self._next != len(self.specs):
            raise WeightSetRejected(f"push ended after {self._next} of {len(self.specs)} tensors")
        self._require_digests()
        expected = set_checksum(self.specs, self.digests)
        if expected != checksum:
            raise WeightSetRejected(f"checksum {expected[:12]} != declared {checksum[:12]}")
        return WeightSpool(self.path, list(self.buckets))

    def abort(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
