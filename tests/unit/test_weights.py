import re

import pytest
import torch

from services.weightsync.buckets import ChecksumMismatch, pack, unpack
from services.weightsync.wire import ModelSignature, TensorSpec, WeightSetRejected, check_finite, checksum


def tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(7, 3, generator=g)),
        ("lm_head.weight", torch.randn(2, 3, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.ones(3, dtype=torch.float16)),
        ("empty", torch.zeros(0)),
    ]


def test_round_trip_through_chunks_restores_every_tensor():
    packed = pack(tensors())
    restored = unpack(packed.specs, b"".join(packed.chunks(size=5)), packed.checksum)
    for (name, t), (rname, r) in zip(tensors(), restored):
        assert name == rname and r.dtype == t.dtype and torch.equal(r, t)


def test_checksum_covers_values_names_and_order():
    base = checksum(tensors())
    assert base == pack(tensors()).checksum
    changed = tensors()
    changed[0][1][0, 0] += 1e-3
    assert checksum(changed) != base
    renamed = tensors()
    renamed[2] = ("model.norm.bias", renamed[2][1])
    assert checksum(renamed) != base
    assert checksum(list(reversed(tensors()))) != base


def test_corrupted_or_short_payload_is_rejected_before_anything_is_returned():
    packed = pack(tensors())
    corrupted = bytearray(packed.payload)
    corrupted[3] ^= 0xFF
    with pytest.raises(ChecksumMismatch, match="checksum"):
        unpack(packed.specs, bytes(corrupted), packed.checksum)
    with pytest.raises(ChecksumMismatch, match="bytes"):
        unpack(packed.specs, packed.payload[:-1], packed.checksum)


def test_signature_accepts_the_exact_set_in_any_order():
    signature = ModelSignature.of(tensors())
    signature.check(list(reversed(pack(tensors()).specs)))
    assert signature.total_bytes == len(pack(tensors()).payload)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda ts: [], "empty weight set"),
        (lambda ts: ts[:-2], "incomplete weight set: 2 of 4 tensors missing, first 'model.norm.weight'"),
        (lambda ts: ts + [("model.layers.99.weight", torch.zeros(3))], "'model.layers.99.weight' is not a parameter"),
        (lambda ts: [ts[0], ts[0], *ts[1:]], "'model.embed_tokens.weight' appears twice"),
        (lambda ts: [("model.embed_tokens.weight", torch.zeros(3, 7)), *ts[1:]], "'model.embed_tokens.weight': shape"),
        (lambda ts: [ts[0], ("lm_head.weight", ts[1][1].float()), *ts[2:]], "'lm_head.weight': dtype float32"),
    ],
)
def test_signature_rejects_sets_that_do_not_fit_naming_the_first_bad_tensor(edit, match):
    with pytest.raises(WeightSetRejected, match=re.escape(match)):
        ModelSignature.of(tensors()).check(pack(edit(tensors())).specs)


def test_signature_rejects_lying_sizes_and_unknown_dtypes():
    signature = ModelSignature.of(tensors())
    specs = pack(tensors()).specs
    with pytest.raises(WeightSetRejected, match="declares 1000 bytes"):
        signature.check([TensorSpec(specs[0].name, specs[0].dtype, specs[0].shape, 1000), *specs[1:]])
    odd = ModelSignature({"w": ("Tensor", (2,))})
    with pytest.raises(WeightSetRejected, match="unknown dtype 'Tensor'"):
        odd.check([TensorSpec("w", "Tensor", (2,), 8)])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_rejected_naming_the_tensor(bad):
    ts = tensors()
    ts[1][1][1, 2] = bad
    with pytest.raises(WeightSetRejected, match="'lm_head.weight' holds NaN or Inf"):
        check_finite(ts)
    check_finite(tensors())


def test_signature_of_pretrained_has_the_hf_names_the_learner_pushes(tmp_path):
    from transformers import AutoModelForCausalLM

    from services.common.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "model", ["a b c", "c b a"], tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    signature = ModelSignature.of_pretrained(str(path), "float32")
    assert signature == ModelSignature.of(model.state_dict().items())
    assert "lm_head.weight" in signature.tensors


def test_finite_check_tells_huge_finite_values_from_nan_and_inf():
    huge = torch.full((4,), 3e38)  # its float32 sum overflows, its values are finite
    check_finite([("huge", huge), ("half", torch.full((8,), 6e4, dtype=torch.float16))])
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.zeros(1000, dtype=torch.bfloat16)
        t[500] = bad
        with pytest.raises(WeightSetRejected, match="'t' holds NaN or Inf"):
            check_finite([("t", t)])


def test_finite_check_of_many_tensors_names_the_bad_one_past_huge_finite_ones():
    bad = torch.zeros(16)
    bad[3] = float("nan")
    named = [("ok", torch.ones(4)), ("huge", torch.full((4,), 3e38)), ("ints", torch.arange(3)), ("bad", bad)]
    with pytest.raises(WeightSetRejected, match="'bad' holds NaN or Inf"):
        check_finite(named)
    check_finite(named[:3])
    check_finite([])
