"""The varlen flash kernel (CUDA, bf16) against one causal SDPA call per document: the same outputs and
gradients, with grouped-query heads and ragged documents, a one-token document among them."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_flash_matches_per_document_attention():
    from services.learner.varlen_attention import _flash, _per_document

    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = [700, 1, 33, 1290]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    total, scale = bounds[-1], 64**-0.5

    def tensors(heads):
        return torch.randn(total, heads, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()

    q, k, v = tensors(14), tensors(2), tensors(2)
    weights = torch.randn(total, 14, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor(bounds, device="cuda", dtype=torch.int32)
    results = []
    for attend in (lambda: _flash(q, k, v, cu, max(lengths), scale), lambda: _per_document(q, k, v, bounds, scale)):
        out = attend()
        grads = torch.autograd.grad((out.float() * weights.float()).sum(), (q, k, v))
        results.append((out.float(), [g.float() for g in grads]))
    (flash, flash_grads), (reference, reference_grads) = results
    torch.testing.assert_close(flash, reference, rtol=2e-2, atol=2e-2)
    for got, want in zip(flash_grads, reference_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)
