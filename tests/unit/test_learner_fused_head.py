"""The fused LM head (`learner.logprob_head: fused`): the dense path's values and gradients, without any
[tokens, V] tensor kept for the backward pass."""

import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from services.learner.fused_head import head_token_stats
from services.learner.model import load_model, token_logprobs, token_logprobs_and_entropy
from services.learner.trainer import PolicyTrainer
from tests.support.learner import make_config, untimed
from tests.support.smoke import build_tiny_llama, synthetic_trajectories
from tests.support.triton_interpreter import run_interpreted


def _dense(hidden, weight, bias, targets):
    z = F.linear(hidden, weight, bias).float()
    log_p = z.log_softmax(-1)
    return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def _grads(fn, leaves, entropy_in_loss):
    gen = torch.Generator().manual_seed(7)
    lp, ent = fn()
    g_lp = torch.randn(lp.shape, generator=gen, dtype=lp.dtype)
    loss = (lp * g_lp).sum()
    if entropy_in_loss:
        loss = loss + (ent * torch.randn(ent.shape, generator=gen, dtype=ent.dtype)).sum()
    return lp.detach(), ent.detach(), torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])  # 37 rows: one chunk a row, uneven, exact, larger than all
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("entropy_in_loss", [False, True])
@pytest.mark.parametrize("keep_logits", [False, True], ids=["recomputed", "kept"])
def test_values_and_gradients_equal_the_dense_head(chunk, with_bias, entropy_in_loss, keep_logits):
    gen = torch.Generator().manual_seed(0)
    n, d, v = 37, 16, 50
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, generator=gen, dtype=torch.float64, requires_grad=True) if with_bias else None
    targets = torch.randint(v, (n,), generator=gen)
    leaves = [x for x in (hidden, weight, bias) if x is not None]
    dense = _grads(lambda: _dense(hidden, weight, bias, targets), leaves, entropy_in_loss)
    fused = _grads(
        lambda: head_token_stats(hidden, weight, bias, targets, chunk, keep_logits=keep_logits), leaves, entropy_in_loss
    )
    # both take the softmax in float32 (of float64 inputs here): float32 rounding is the tolerance
    for got, want in zip(fused[:2], dense[:2]):
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=2e-5)
    for got, want in zip(fused[2], dense[2]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_logprobs_only_leave_the_entropy_out_of_the_graph():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 8, generator=gen, requires_grad=True)
    weight = torch.randn(20, 8, generator=gen, requires_grad=True)
    targets = torch.randint(20, (9,), generator=gen)
    lp, ent = head_token_stats(hidden, weight, None, targets, 4, with_entropy=False)
    assert (ent == 0).all() and not ent.requires_grad
    lp.sum().backward()
    want_lp, _ = _dense(hidden, weight, None, targets)
    torch.testing.assert_close(lp, want_lp)
    grad_h = hidden.grad.clone()
    hidden.grad = None
    want_lp.sum().backward()
    torch.testing.assert_close(grad_h, hidden.grad, rtol=1e-5, atol=1e-6)


def test_bf16_inputs_give_float32_outputs_and_input_dtype_gradients():
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(12, 16, generator=gen).bfloat16().requires_grad_()
    weight = torch.randn(40, 16, generator=gen).bfloat16().requires_grad_()
    targets = torch.randint(40, (12,), generator=gen)
    lp, ent = head_token_stats(hidden, weight, None, targets, 5)
    assert lp.dtype == ent.dtype == torch.float32
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    want_lp, want_ent = _dense(hidden, weight, None, targets)
    torch.testing.assert_close(lp, want_lp)
    torch.testing.assert_close(ent, want_ent)


def test_the_backward_pass_keeps_no_vocabulary_sized_activation():
    saved = []
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(64, 8, generator=gen, requires_grad=True)
    weight = torch.randn(101, 8, generator=gen, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        head_token_stats(hidden, weight, None, torch.randint(101, (64,), generator=gen), 16)
    assert (101, 8) in saved  # the weight itself
    assert not [s for s in saved if s[-1:] == (101,)]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model_dir(request, tmp_path_factory):
    return str(build_tiny_llama(tmp_path_factory.mktemp("fused") / "model", tie=request.param))


def _ragged():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 64, (4, 9), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate((9, 2, 6, 1)):
        mask[row, :n] = 1
    return ids, mask


def _model_stats(model, chunk, pack, entropy_in_loss):
    ids, mask = _ragged()
    model.zero_grad(set_to_none=True)
    lp, ent = token_logprobs_and_entropy(model, ids, mask, chunk, pack)
    weights = torch.linspace(-1.0, 1.0, lp.numel(), dtype=lp.dtype).reshape(lp.shape)
    loss = (lp * weights * mask).sum()
    if entropy_in_loss:
        loss = loss + (ent * weights.flip(-1) * mask).sum()
    loss.backward()
    return lp.detach() * mask, ent.detach() * mask, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("entropy_in_loss", [False, True])
def test_model_logprobs_entropy_and_gradients_equal_dense(model_dir, pack, entropy_in_loss):
    dense = load_model(model_dir, "float32", head="recompute").double()
    fused = load_model(model_dir, "float32", head="fused").double()
    lp, ent, grads = _model_stats(dense, 0, False, entropy_in_loss)
    lp_f, ent_f, grads_f = _model_stats(fused, 5, pack, entropy_in_loss)
    torch.testing.assert_close(lp_f, lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent_f, ent, rtol=1e-6, atol=1e-6)
    assert grads.keys() == grads_f.keys()
    for name in grads:  # tied: the embedding's gradient sums the head's and the lookup's
        torch.testing.assert_close(grads_f[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)
    ids, mask = _ragged()
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(fused, ids, mask, 5, pack) * mask, lp, rtol=1e-6, atol=1e-6)


def test_unknown_head_is_refused(model_dir):
    with pytest.raises(ValueError, match="logprob head"):
        load_model(model_dir, head="triton")
    with pytest.raises(ValueError, match="head kernel"):
        load_model(model_dir, head_kernel="cuda")


def test_kept_logits_are_the_recomputed_ones_and_dropped_after_the_backward_pass():
    """`keep_logits`: the backward pass reads the forward pass's logits (no recompute: a patched linear that
    counts its calls sees only the forward's chunks), drops them as it goes, and a second backward pass over a
    retained graph recomputes them; under no_grad nothing is kept."""
    from services.learner import fused_head

    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(20, 8, generator=gen, requires_grad=True)
    weight = torch.randn(30, 8, generator=gen, requires_grad=True)
    targets = torch.randint(30, (20,), generator=gen)
    calls = []
    linear = fused_head.F.linear

    def counted(*args):
        calls.append(args[0].shape[0])
        return linear(*args)

    want = torch.autograd.grad(head_token_stats(hidden, weight, None, targets, 8)[0].sum(), [hidden, weight])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_head.F, "linear", counted)
        lp, _ = head_token_stats(hidden, weight, None, targets, 8, keep_logits=True)
        assert calls == [8, 8, 4]
        node = lp.grad_fn
        assert [t.shape for t in node.kept] == [(8, 30), (8, 30), (4, 30)]
        got = torch.autograd.grad(lp.sum(), [hidden, weight], retain_graph=True)
        assert calls == [8, 8, 4] and node.kept == []
        again = torch.autograd.grad(lp.sum(), [hidden, weight])
        assert calls == [8, 8, 4, 8, 8, 4]
        with torch.no_grad():
            assert head_token_stats(hidden, weight, None, targets, 8, keep_logits=True)[0].grad_fn is None
    for g, a, w in zip(got, again, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
        torch.testing.assert_close(a, w, rtol=0, atol=0)


_TRITON_RUN = """
import torch
from services.learner import fused_head, head_kernel

torch.manual_seed(0)
n, d, v = 11, 16, 5000  # v: one full 4096-column block and a part one
for dtype in (torch.float32, torch.bfloat16):
    z = (4 * torch.randn(n, v)).to(dtype)
    t = torch.randint(v, (n,))
    t[0], t[1] = 0, v - 1
    got = head_kernel.stats(z, t)
    want = fused_head._stats(z, t, True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=2e-5)
    g_lp, g_ent = torch.randn(n), torch.randn(n)
    for ge in (None, g_ent):
        g = head_kernel.logits_grad(z, t, want[0], want[2], g_lp, ge, dtype)
        w = fused_head._logits_grad(z, t, want[0], want[2], g_lp, ge, dtype)
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), w.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)
    bad = t.clone()
    bad[2], bad[3] = v, -1
    lp = head_kernel.stats(z, bad)[1]
    assert lp[2:4].isnan().all() and lp[4:].isfinite().all()
for keep in (False, True):
    hidden = torch.randn(n, d, requires_grad=True)
    weight = torch.randn(v, d, requires_grad=True)
    t = torch.randint(v, (n,))
    out = []
    for kernel in ("torch", "triton"):
        lp, ent = fused_head.head_token_stats(hidden, weight, None, t, 4, kernel=kernel, keep_logits=keep)
        out.append((lp, ent, *torch.autograd.grad((lp * torch.arange(n)).sum() + 0.3 * ent.sum(), [hidden, weight])))
    for g, w in zip(out[1], out[0]):  # gradients: float32 sums over 5,000 columns in another order
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
print("ok")
"""


def test_triton_kernels_equal_the_torch_formulation_in_the_interpreter():
    """The head's Triton kernels, run by Triton's interpreter on CPU, against the torch formulation:
    statistics in float32 and bf16 over a vocabulary of one full and one part block, the gradient with and
    without the entropy's term, a target outside the vocabulary giving a NaN logprob, and the whole head's
    values and gradients through `kernel="triton"`, with the logits kept and recomputed."""
    assert run_interpreted(_TRITON_RUN).strip().endswith("ok")


def test_auto_takes_the_torch_formulation_off_cuda_and_after_a_failed_build(monkeypatch):
    from services.learner import fused_head

    torch_fns = fused_head._kernels(False)
    assert fused_head._elementwise("auto", False, torch.device("cpu")) == torch_fns
    assert fused_head._elementwise("torch", False, torch.device("cuda")) == torch_fns
    stats, _ = fused_head._elementwise("auto", False, torch.device("cuda"))
    assert stats.func is fused_head._triton_stats and stats.keywords["fallback"] is torch_fns[0]

    def broken(*_args):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(fused_head, "_triton_broken", [])
    monkeypatch.setitem(sys.modules, "services.learner.head_kernel", SimpleNamespace(stats=broken, logits_grad=broken))
    z, t = torch.randn(3, 7), torch.tensor([0, 6, 2])
    lse, lp, ent = stats(z, t, True)
    torch.testing.assert_close(lp, torch_fns[0](z, t, True)[1])
    assert fused_head._triton_broken and fused_head._elementwise("auto", False, torch.device("cuda")) == torch_fns
    strict, _ = fused_head._elementwise("triton", False, torch.device("cuda"))
    with pytest.raises(RuntimeError, match="no compiler"):
        strict(z, t, True)


@pytest.mark.parametrize("entropy_coeff", [0.0, 0.01])
def test_train_step_equals_the_recompute_head(model_dir, entropy_coeff):
    trajs = synthetic_trajectories(8, 4, seed=5)

    def step(head):
        learner = {"logprob_chunk_tokens": 7, "logprob_head": head, "pack_sequences": True}
        trainer = PolicyTrainer(make_config(learner, entropy_coeff=entropy_coeff, ppo_epochs=2), model_dir)
        return [untimed(trainer.train_step(trajs)) for _ in range(2)]

    recompute, fused = step("recompute"), step("fused")
    for want, got in zip(recompute, fused):
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.slow  # torch.compile on CPU: ~30 s of C++ builds
def test_compiled_kernels_give_the_eager_values_and_gradients():
    gen = torch.Generator().manual_seed(4)
    for n in (37, 20):  # a second length: the compiled graphs are shape-dynamic, not recompiled per chunk count
        hidden = torch.randn(n, 16, generator=gen, requires_grad=True)
        weight = torch.randn(50, 16, generator=gen, requires_grad=True)
        targets = torch.randint(50, (n,), generator=gen)
        out = []
        for compiled in (False, True):
            lp, ent = head_token_stats(hidden, weight, None, targets, 8, compiled=compiled)
            out.append((lp, ent, *torch.autograd.grad(lp.sum() + 0.3 * ent.sum(), [hidden, weight])))
        for got, want in zip(out[1], out[0]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pointwise_logits_gradient_equals_the_scatter_one(with_entropy, dtype):
    """The compiled head's form (the target's term added where the column is the target) against the eager
    scatter: the same float32 sum per element, so the same values after the cast."""
    from services.learner.fused_head import _logits_grad, _logits_grad_pointwise

    gen = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(9, 40, generator=gen)).to(dtype)
    targets = torch.randint(40, (9,), generator=gen)
    targets[1] = 0  # the first and last columns
    targets[2] = 39
    z = logits.float()
    lse = torch.logsumexp(z, -1)
    p = torch.exp(z - lse[:, None])
    ent = lse - (p * z).sum(-1)
    g_lp = torch.randn(9, generator=gen)
    g_ent = torch.randn(9, generator=gen) if with_entropy else None
    args = (logits, targets, lse, ent, g_lp, g_ent, dtype)
    want, got = _logits_grad(*args), _logits_grad_pointwise(*args)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
