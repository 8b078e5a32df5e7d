"""The fused LM head on CUDA in bf16 at the Qwen2.5 vocabulary, eager, compiled and with the Triton kernels
(logits recomputed or kept), against the dense path (bf16 logits, fp32 log-softmax, autograd): the same
logprobs, entropies and gradients to bf16 rounding."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize(
    "compiled, kernel, keep",
    [(False, "torch", False), (True, "torch", False), (False, "triton", False), (False, "triton", True)],
    ids=["eager", "compiled", "triton", "triton-kept"],
)
def test_fused_head_matches_dense_bf16(compiled, kernel, keep):
    from services.learner.fused_head import head_token_stats

    gen = torch.Generator(device="cuda").manual_seed(0)
    n, d, v = 3001, 896, 151936  # rows: not a multiple of the chunk
    hidden = torch.randn(n, d, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(v, d, device="cuda", generator=gen) * d**-0.5).bfloat16().requires_grad_()
    targets = torch.randint(v, (n,), device="cuda", generator=gen)
    g_lp, g_ent = (torch.randn(n, device="cuda", generator=gen) for _ in range(2))

    def dense():
        log_p = F.linear(hidden, weight).float().log_softmax(-1)
        return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)

    out = []
    for fn in (dense, lambda: head_token_stats(hidden, weight, None, targets, 1024, True, compiled, kernel, keep)):
        lp, ent = fn()
        grads = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (hidden, weight))
        out.append((lp.detach(), ent.detach(), *grads))
    for got, want in zip(out[1], out[0], strict=True):
        assert got.dtype == want.dtype
        assert _relative_error(got, want) < 1e-2
    torch.testing.assert_close(out[1][0], out[0][0], rtol=0, atol=5e-2)  # per token: a bf16 ulp of a logit
