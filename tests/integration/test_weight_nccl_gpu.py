"""The `sum64` bucket digest on CUDA: the same text as on CPU for the same bytes (int64 sums wrap alike on
both), and its finite check clearing a bf16 bucket and seeing an inf or a NaN in it, from a few bytes up to
a 256 MB bucket."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("nbytes", [0, 14, 8192 * 3 + 8 * 1023 + 6, 256 << 20])
def test_sum64_on_cuda_equals_cpu_and_checks_finite_values(nbytes):
    from services.weightsync.digest import _sum64_checked, sum64

    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert sum64(data.cuda()) == sum64(data)
    values = torch.randn(nbytes // 2, generator=torch.Generator().manual_seed(1)).bfloat16().cuda()
    assert _sum64_checked(values.view(torch.uint8), torch.bfloat16) == (sum64(values.view(torch.uint8).cpu()), True)
    for poison in (float("inf"), float("nan")) if nbytes else ():
        bad = values.clone()
        bad[-1] = poison
        digest, finite = _sum64_checked(bad.view(torch.uint8), torch.bfloat16)
        assert digest == sum64(bad.view(torch.uint8).cpu()) and not finite


def test_cuda_buckets_are_digested_by_the_one_pass_kernel_and_its_finite_check_is_exact(monkeypatch):
    """On CUDA the digest and the finite check are the Triton kernel's (one read of the bucket); the torch
    formulation (`OMRL_SUM64_KERNEL=0`, or a kernel that fails to build) gives the same digest. fp32 values
    whose float32 sum overflows are finite to the kernel (the sum's check sent such a bucket to the
    tensor-by-tensor check)."""
    from services.weightsync import digest as digest_module
    from services.weightsync import sum64_kernel
    from services.weightsync.digest import _kernel_sums, _sum64_checked, sum64

    big = torch.full((1 << 20,), 3e38, dtype=torch.float32, device="cuda")
    assert _kernel_sums(big.view(torch.uint8), torch.float32).tolist()[2] == 0
    digest, finite = _sum64_checked(big.view(torch.uint8), torch.float32)
    assert finite and digest == sum64(big.view(torch.uint8).cpu())
    monkeypatch.setenv("OMRL_SUM64_KERNEL", "0")
    assert _kernel_sums(big.view(torch.uint8), None) is None
    assert _sum64_checked(big.view(torch.uint8), torch.float32) == (digest, False)  # the sum overflowed
    monkeypatch.delenv("OMRL_SUM64_KERNEL")

    def unbuildable(*args):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(sum64_kernel, "sums", unbuildable)
    monkeypatch.setattr(digest_module, "_kernel_broken", [])
    assert sum64(big.view(torch.uint8)) == digest and digest_module._kernel_broken


def test_cuda_buckets_are_staged_through_pinned_buffers_at_their_offsets(tmp_path):
    """The vLLM worker's staging of CUDA buckets: copied to pinned host memory on the current stream and written
    by threads; the device buffer overwritten right after (as the receive after next does, ordered after that
    stream) does not change what lands in the file. A write that fails raises at `drain`."""
    from services.weightsync.nccl.staging import BucketStager

    spool = tmp_path / "w.spool"
    spool.write_bytes(b"")
    sizes, offsets = (64 << 20, 5, (32 << 20) + 3, 0, 4 << 20), (0, 64 << 20, (65 << 20), 100 << 20, 100 << 20)
    buffers = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(2)]
    expected, stager = [], BucketStager()
    for k, (n, offset) in enumerate(zip(sizes, offsets, strict=True)):
        data = buffers[k % 2][:n]
        data.random_(0, 256)
        expected.append(data.cpu().numpy().tobytes())
        stager.stage(str(spool), offset, data)
        data.fill_(7)  # the receive after next lands here, ordered after the copy on this stream
    stager.drain()
    written = spool.read_bytes()
    for data, offset in zip(expected, offsets, strict=True):
        assert written[offset : offset + len(data)] == data
    stager.stage(str(tmp_path / "gone.spool"), 0, buffers[0][:8])
    with pytest.raises(FileNotFoundError):
        stager.drain()
    stager.close()


def test_cuda_buckets_staged_in_a_pinned_arena_come_back_as_they_were():
    """`rollout.weight_staging: memory` on a GPU: each bucket one copy into pinned host memory on the current
    stream; the device buffer overwritten right after (the receive after next) does not change the arena."""
    from services.weightsync.nccl.staging import HostArena
    from services.weightsync.wire import TensorSpec

    arena, buffer = HostArena(), torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    arena.begin(HostArena.span(3 * (32 << 20), 3), pinned=True)
    expected = []
    for k in range(3):
        buffer.random_(0, 256)
        expected.append(buffer.cpu())
        arena.stage("p", k << 25, buffer)
        buffer.fill_(7)
    arena.drain()
    for k, data in enumerate(expected):
        ((_, got),) = arena.tensors("p", k << 25, [TensorSpec("t", "uint8", (32 << 20,), 32 << 20)])
        assert got.is_pinned() and torch.equal(got, data)
