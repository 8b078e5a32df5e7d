"""The `nccl` weight push's settings and its pure pieces: config validation, the rendezvous, bucket
digests (CPU), the set checksum over digests, and the server's staging rules (declarations, digest format,
commit) without any process group."""

import json
import logging

import jsonschema
import pytest
import torch
import yaml
from pydantic import ValidationError

from services.common import config as config_module
from services.common.config import LearnerConfig, dump_config, load_config
from services.common.config_cli import resolve
from services.jobs.spec import JobSpec
from services.weightsync import PUSHERS
from services.weightsync.buckets import plan_buckets
from services.weightsync.digest import _sum64_text, bucket_digest, set_checksum
from services.weightsync.nccl.group import Rendezvous
from services.weightsync.nccl.pack import pack_buckets
from services.weightsync.nccl.receive import ParamCopier, check_against
from services.weightsync.nccl.staging import NcclStaging
from services.weightsync.wire import WeightSetRejected, spec_of, tensor_views
from tests.support.triton_interpreter import run_interpreted


def _learner(*overrides):
    return load_config(None, [f"learner.{o}" for o in overrides]).learner


def test_nccl_is_a_registered_transport_with_its_defaults():
    cfg = _learner("weight_push=nccl", "weight_nccl_host=omrl-learner")
    assert PUSHERS.get("nccl").__name__ == "NcclWeightPusher"
    assert (cfg.weight_nccl_port, cfg.weight_nccl_backend, cfg.weight_nccl_timeout_s) == (29600, "auto", 60.0)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["weight_push=nccl"], "needs learner.weight_nccl_host"),
        (["weight_push=nccl", "weight_nccl_host=h", "weight_nccl_backend=nccl", "device=cpu"], "learner runs on CPU"),
        (["weight_push=nccl", "weight_nccl_host=h", "weight_nccl_backend=gloo", "device=cuda"], "use nccl"),
        (["weight_nccl_port=80"], "greater than or equal to 1024"),
        (["weight_nccl_backend=mpi"], "'auto', 'gloo' or 'nccl'"),
        (["weight_nccl_timeout_s=0"], "greater than 0"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(overrides, words):
    with pytest.raises(ValidationError, match=words):
        _learner(*overrides)


def test_the_grpc_transport_needs_no_rendezvous():
    assert _learner("weight_push=grpc").weight_nccl_host == ""


RENAMED = [  # old name, new name, a value other than the default
    ("weight_dist_host", "weight_nccl_host", "omrl-learner-weights"),
    ("weight_dist_port", "weight_nccl_port", 29700),
    ("weight_dist_backend", "weight_nccl_backend", "gloo"),
    ("weight_dist_timeout_s", "weight_nccl_timeout_s", 30.0),
]


def test_the_renamed_config_keys_load_under_their_new_names():
    cfg = _learner(*(f"{new}={value}" for _, new, value in RENAMED))
    assert [getattr(cfg, new) for _, new, _ in RENAMED] == [value for _, _, value in RENAMED]
    assert all(old not in LearnerConfig.model_fields for old, _, _ in RENAMED)


@pytest.mark.parametrize("old, new, value", RENAMED)
def test_an_old_config_key_still_loads_and_dumps_under_its_new_name(old, new, value, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(config_module, "_warned_renames", set())
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"learner": {old: value}}))
    with caplog.at_level(logging.WARNING, logger="services.common.config"):
        from_file = load_config(str(path))
        load_config(str(path))  # warned once per process
    assert getattr(from_file.learner, new) == value == getattr(_learner(f"{new}={value}"), new)
    assert [r.getMessage() for r in caplog.records] == [
        f"config: learner.{old} is deprecated, renamed to learner.{new}; it still loads, but rename it"
    ]
    dumped = yaml.safe_load(dump_config(from_file))["learner"]
    assert dumped[new] == value and old not in dumped
    assert getattr(JobSpec.model_validate({"learner": {old: value}}).learner, new) == value  # a stored job spec
    # a later layer's new name overrides an earlier layer's old one, as one name would
    assert getattr(resolve(JobSpec, str(path), [f"learner.{new}={value}"], environ={}).config.learner, new) == value


@pytest.mark.parametrize("old, new, value", RENAMED)
def test_an_old_and_a_new_config_key_together_are_refused_naming_both(old, new, value):
    for load in (
        lambda: _learner(f"{old}={value}", f"{new}={value}"),
        lambda: JobSpec.model_validate({"learner": {old: value, new: value}}),
    ):
        with pytest.raises(ValidationError, match=f"learner.{new} and learner.{old} are both set"):
            load()


def test_the_config_schema_takes_an_old_key_as_deprecated_but_not_both_names():
    """Helm values and the job API's OpenAPI document are checked against this schema."""
    schema = LearnerConfig.model_json_schema()
    for old, new, value in RENAMED:
        assert schema["properties"][old]["deprecated"] is True
        jsonschema.validate({old: value}, schema)
        jsonschema.validate({new: value}, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({old: value, new: value}, schema)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(backend="mpi"), "backend"),
        (dict(port=0), "not a TCP port"),
        (dict(group="a/b"), "group name"),
    ],
)
def test_a_bad_rendezvous_is_refused(kw, words):
    args = dict(host="h", port=29600, group="g", backend="gloo", timeout_s=5.0) | kw
    with pytest.raises(ValueError, match=words):
        Rendezvous(**args)


def _named():
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 4, generator=g)),
        ("b", torch.randn(5, generator=g)),
        ("c", torch.randn(700, generator=g)),
    ]


def test_cpu_buckets_carry_the_sha256_of_their_bytes_and_unpack_to_the_tensors():
    named = _named()
    specs = [spec_of(n, t) for n, t in named]
    buckets = list(pack_buckets(named, specs, 100, "cpu"))
    assert [len(b.specs) for b in buckets] == [2, 1]  # 48 + 20 bytes, then 2800 alone
    for b in buckets:
        assert b.digest.startswith("sha256:") and b.digest == bucket_digest(b.data.clone())
    got = dict(t for b in buckets for t in tensor_views(b.specs, b.data))
    assert all(torch.equal(got[n], t) for n, t in named)


def test_set_checksum_covers_specs_and_digests_in_order():
    specs = [spec_of(n, t) for n, t in _named()]
    assert set_checksum(specs, ["d1", "d2"]) != set_checksum(specs, ["d2", "d1"])
    assert set_checksum(specs, ["d1"]) != set_checksum(specs[:2], ["d1"])


def test_check_against_refuses_an_unknown_name_or_another_shape_and_a_param_copier_applies():
    params = {n: torch.zeros_like(t) for n, t in _named()}
    named = _named()
    with pytest.raises(WeightSetRejected, match="unknown tensor"):
        check_against(params, [spec_of("z", named[0][1])])
    with pytest.raises(WeightSetRejected, match="'a'"):
        check_against(params, [spec_of("a", named[0][1].T.contiguous())])
    check_against(params, [spec_of(n, t) for n, t in named])
    ParamCopier(params)(named)
    assert torch.equal(params["c"], named[2][1])


def test_staging_checks_declarations_digests_and_the_commit(tmp_path):
    named = _named()
    specs = [spec_of(n, t) for n, t in named]
    buckets = list(pack_buckets(named, specs, 100, "cpu"))
    staging = NcclStaging(specs, 100, sum(s.nbytes for s in specs), str(tmp_path))
    with pytest.raises(WeightSetRejected, match="digest"):
        staging.declare(buckets[0].specs, buckets[0].nbytes, "md5:00")
    with pytest.raises(WeightSetRejected, match="header's next tensor"):
        staging.declare(buckets[1].specs, buckets[1].nbytes, buckets[1].digest)
    info = staging.declare(buckets[0].specs, buckets[0].nbytes, buckets[0].digest)
    assert info["kind"] == "receive" and info["offset"] == 0 and info["names"] == ["a", "b"]
    with pytest.raises(WeightSetRejected, match="after 2 of 3 tensors"):
        staging.commit(set_checksum(specs, [buckets[0].digest]))
    info = staging.declare(buckets[1].specs, buckets[1].nbytes, buckets[1].digest)
    assert info["offset"] > 0 and info["offset"] % 4096 == 0  # each bucket mapped on its own
    with pytest.raises(WeightSetRejected, match="checksum"):
        staging.commit("0" * 64)
    spool = staging.commit(set_checksum(specs, [b.digest for b in buckets]))
    assert [b.specs for b in spool.buckets] == [b.specs for b in buckets]
    staging.abort()
    assert not list(tmp_path.iterdir())


def test_the_gpu_digest_sees_a_flipped_byte_swapped_words_and_a_shorter_buffer():
    from services.weightsync.digest import sum64

    data = torch.randint(0, 256, (4099,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    digest = sum64(data)
    assert digest.startswith("sum64:") and len(digest) == 6 + 48 and sum64(data.clone()) == digest
    flipped = data.clone()
    flipped[17] ^= 1
    swapped = data.clone()
    swapped[:8], swapped[8:16] = data[8:16].clone(), data[:8].clone()
    assert len({digest, sum64(flipped), sum64(swapped), sum64(data[:-1])}) == 4


def test_the_gpu_digest_sees_words_moved_between_rows():
    from services.weightsync.digest import sum64

    data = torch.randint(0, 256, (8 * 3000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    moved = data.clone()
    a, b = 8 * 5, 8 * (1024 + 5)  # the same column of two rows
    moved[a : a + 8], moved[b : b + 8] = data[b : b + 8].clone(), data[a : a + 8].clone()
    assert sum64(moved) != sum64(data)
    assert sum64(torch.empty(0, dtype=torch.uint8)).startswith("sum64:" + "0" * 16)


def test_staging_where_digests_follow_their_buckets_hands_each_to_the_next_receive_and_the_flush(tmp_path):
    named = _named()
    specs = [spec_of(n, t) for n, t in named]
    buckets = list(pack_buckets(named, specs, 100, "cpu"))
    digests = [b.digest for b in buckets]
    staging = NcclStaging(specs, 100, sum(s.nbytes for s in specs), str(tmp_path), digests_follow=True)
    with pytest.raises(WeightSetRejected, match="no bucket declared"):
        staging.add_digest(digests[0])
    with pytest.raises(WeightSetRejected, match="a declaration carries none"):
        staging.declare(buckets[0].specs, buckets[0].nbytes, digests[0])
    assert staging.declare(buckets[0].specs, buckets[0].nbytes, "")["previous_digest"] == ""
    with pytest.raises(WeightSetRejected, match="digest of bucket 0 did not follow"):
        staging.declare(buckets[1].specs, buckets[1].nbytes, "")
    with pytest.raises(WeightSetRejected, match="digest of bucket 0 did not follow"):
        staging.last_digest()
    with pytest.raises(WeightSetRejected, match="not sha256"):
        staging.add_digest("md5:00")
    staging.add_digest(digests[0])
    with pytest.raises(WeightSetRejected, match="no bucket declared"):
        staging.add_digest(digests[0])  # one digest a bucket
    info = staging.declare(buckets[1].specs, buckets[1].nbytes, "")
    assert (info["digest"], info["previous_digest"]) == ("", digests[0])
    with pytest.raises(WeightSetRejected, match="digest of bucket 1 did not follow"):
        staging.commit(set_checksum(specs, digests))
    staging.add_digest(digests[1])
    assert staging.last_digest() == digests[1]
    spool = staging.commit(set_checksum(specs, digests))  # the same set checksum as digests in declarations
    assert [b.specs for b in spool.buckets] == [b.specs for b in buckets]
    staging.abort()
    plain = NcclStaging(specs, 100, sum(s.nbytes for s in specs), str(tmp_path))
    with pytest.raises(WeightSetRejected, match="whose declarations carry them"):
        plain.add_digest(digests[0])
    assert plain.last_digest() == ""
    plain.abort()


def test_the_receiver_checks_a_bucket_against_the_digest_that_followed_it():
    from services.weightsync.nccl.receive import BucketReceiver

    named = _many(4)
    specs = [spec_of(n, t) for n, t in named]
    buckets = list(pack_buckets(named, specs, 100, "cpu"))
    receiver = BucketReceiver(_LoopbackGroup([b.data for b in buckets]))
    assert receiver.post(buckets[0].specs, buckets[0].nbytes, "") is None
    got = {}  # the views stay valid until the bucket after next is posted: copied
    for k in range(1, len(buckets)):
        earlier = receiver.post(buckets[k].specs, buckets[k].nbytes, "", previous_digest=buckets[k - 1].digest)
        got.update((n, t.clone()) for n, t in earlier)
    got.update((n, t.clone()) for n, t in receiver.flush(previous_digest=buckets[-1].digest))
    assert all(torch.equal(got[n], t) for n, t in named)
    wrong = BucketReceiver(_LoopbackGroup([b.data for b in buckets]))
    wrong.post(buckets[0].specs, buckets[0].nbytes, "")
    with pytest.raises(WeightSetRejected, match="do not match the digest"):
        wrong.post(buckets[1].specs, buckets[1].nbytes, "", previous_digest=buckets[1].digest)
    missing = BucketReceiver(_LoopbackGroup([b.data for b in buckets]))
    missing.post(buckets[0].specs, buckets[0].nbytes, "")
    with pytest.raises(WeightSetRejected, match="is not this group's"):
        missing.flush()  # its digest never came


def _sum64_by_definition(data: bytes) -> str:
    """`sum64` written out word by word (Python integers, reduced mod 2**64): the digest peers of different
    versions must agree on, whatever kernels compute it."""
    mask = 2**64 - 1
    padded = data + bytes(-len(data) % 8)
    words = [int.from_bytes(padded[i : i + 8], "little", signed=True) for i in range(0, len(padded), 8)]
    whole = len(data) // 8 // 1024 * 1024  # words in whole rows of 1024
    grid, rest = words[:whole], words[whole:]
    rows = [sum(grid[r * 1024 : (r + 1) * 1024]) for r in range(whole // 1024)]
    columns = [sum(grid[c::1024]) for c in range(1024)]
    plain = sum(rows) + sum(rest)
    weighted = (
        sum((r + 1) * v for r, v in enumerate(rows))
        + 1000003 * sum((c + 1) * v for c, v in enumerate(columns))
        + 7 * sum((k + 1) * v for k, v in enumerate(rest))
    )
    return f"sum64:{len(data):016x}{plain & mask:016x}{weighted & mask:016x}"


def test_the_gpu_digest_is_its_definition_and_its_finite_check_reads_the_sum():
    from services.weightsync.digest import _sum64_checked, sum64

    # a larger bucket first, then smaller ones and a larger one again: the cached weights are cut and regrown
    for nbytes in [8192 * 5 + 8 * 1023 + 7, 0, 5, 8, 8192 - 3, 8192, 8 * 1023, 8192 * 40 + 4]:
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
        assert sum64(data) == _sum64_by_definition(data.numpy().tobytes()), nbytes
        assert _sum64_checked(data, None) == (sum64(data), False)
        if nbytes % 4 == 0:
            values = torch.linspace(-3, 2, nbytes // 4, dtype=torch.float32)
            for poison, finite in ((None, True), (float("inf"), False), (float("-inf"), False), (float("nan"), False)):
                if poison is not None and nbytes:
                    values[-1] = poison
                got = _sum64_checked(values.view(torch.uint8), torch.float32)
                assert got == (sum64(values.view(torch.uint8)), finite or not nbytes), (nbytes, poison)


_KERNEL_CASES = [0, 5, 8, 14, 8192 - 3, 8192, 8 * 1023, 8192 * 5 + 8 * 1023 + 6, 8192 * 40 + 4, (1 << 20) + 2]


def _kernel_case(nbytes: int) -> list[tuple[str, torch.Tensor, torch.dtype | None, int]]:
    """The buffers the one-pass kernel is checked on for one size: raw bytes, and where the size allows bf16 and
    fp32 values without and with an inf and a NaN (name, bytes, dtype, non-finite elements)."""
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    cases = [("bytes", data, None, 0)]
    for dtype, size in ((torch.bfloat16, 2), (torch.float32, 4)):
        if nbytes % size:
            continue
        values = torch.linspace(-3, 2, nbytes // size).to(dtype)
        cases.append((f"{dtype}", values.view(torch.uint8), dtype, 0))
        if nbytes:
            poisoned = values.clone()
            poisoned[-1], poisoned[0] = float("nan"), float("-inf")
            cases.append((f"{dtype} poisoned", poisoned.view(torch.uint8), dtype, 1 + (nbytes > size)))
    return cases


_KERNEL_RUN = """
import json, sys
import torch
from services.weightsync import sum64_kernel
sys.path.insert(0, "tests/unit")
from test_weight_nccl import _KERNEL_CASES, _kernel_case
print(json.dumps([[nbytes, name, sum64_kernel.sums(data, dtype).tolist()]
                  for nbytes in _KERNEL_CASES for name, data, dtype, _ in _kernel_case(nbytes)]))
"""


def test_the_one_pass_gpu_kernel_is_the_digests_definition_and_counts_infs_and_nans():
    """The Triton kernel CUDA buckets are digested with, run by Triton's interpreter on CPU tensors (a CI
    machine has no GPU): the same sums as `sum64`'s definition for every size (tail bytes, part rows, one
    program and several), and the exact count of non-finite bf16 and fp32 elements."""
    stdout = run_interpreted(_KERNEL_RUN)
    got = {(nbytes, name): sums for nbytes, name, sums in json.loads(stdout.strip().splitlines()[-1])}
    for nbytes in _KERNEL_CASES:
        for name, data, _dtype, non_finite in _kernel_case(nbytes):
            plain, weighted, bad = got[nbytes, name]
            assert _sum64_text(nbytes, plain, weighted) == _sum64_by_definition(data.numpy().tobytes()), (nbytes, name)
            assert bad == non_finite, (nbytes, name)


class _LoopbackGroup:
    """A group of one: a broadcast leaves the buffer as the sender filled it (here: from a queue)."""

    class _Work:
        def wait(self):
            pass

    def __init__(self, payloads):
        self.rdv = Rendezvous("h", 29600, "g", "gloo", 5.0)
        self.payloads = list(payloads)

    def post(self, buffer):
        buffer.copy_(self.payloads.pop(0))
        return self._Work()


def test_the_pipelined_receiver_checks_every_bucket_and_refuses_a_bad_digest():
    from services.weightsync.nccl.receive import BucketReceiver

    named = _named()
    specs = [spec_of(n, t) for n, t in named]
    buckets = list(pack_buckets(named, specs, 100, "cpu"))
    receiver = BucketReceiver(_LoopbackGroup([b.data for b in buckets]))
    declared = [(b.specs, b.nbytes) for b in buckets]
    got = {}
    for tensors in receiver.receive_all(declared, lambda i: buckets[i].digest):
        got.update((n, t.clone()) for n, t in tensors)
    assert all(torch.equal(got[n], t) for n, t in named)
    receiver = BucketReceiver(_LoopbackGroup([b.data for b in buckets]))
    with pytest.raises(WeightSetRejected, match="do not match the digest"):
        list(receiver.receive_all(declared, lambda i: buckets[1 - i].digest))


def test_a_param_copier_applies_every_tensor_and_pack_buckets_round_trips():
    named = [(f"w{i}", torch.randn(3, i + 1)) for i in range(5)]
    specs = [spec_of(n, t) for n, t in named]
    buckets = list(pack_buckets(iter(named), specs, bucket_bytes=40, device="cpu"))
    assert len(buckets) > 1
    params = {n: torch.zeros_like(t) for n, t in named}
    for b in buckets:
        ParamCopier(params)(tensor_views(b.specs, b.data))
    for n, t in named:
        assert torch.equal(params[n], t)


def test_the_gpu_bucket_check_reads_the_digest_and_the_finite_sum_back_together():
    from services.weightsync.digest import _sum64_checked, sum64

    good = torch.randn(300, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    buffer = good.view(torch.uint8)
    assert _sum64_checked(buffer, torch.bfloat16) == (sum64(buffer), True)
    bad = good.clone()
    bad[123] = float("inf")
    digest, finite = _sum64_checked(bad.view(torch.uint8), torch.bfloat16)
    assert digest == sum64(bad.view(torch.uint8)) != sum64(buffer) and not finite
    assert _sum64_checked(buffer, None) == (sum64(buffer), False)  # mixed dtypes: checked tensor by tensor


def _many(n=6):
    g = torch.Generator().manual_seed(4)
    return [(f"t{i}", torch.randn(24 - i, generator=g)) for i in range(n)]  # one a bucket of 100 B


def test_packing_in_two_slots_reuses_their_buffers_and_each_bucket_is_right_when_yielded():
    named = _many()
    specs = [spec_of(n, t) for n, t in named]
    fresh = [(b.specs, b.data.clone(), b.digest) for b in pack_buckets(named, specs, 100, "cpu")]
    seen, ptrs = [], []
    for b in pack_buckets(named, specs, 100, "cpu", slots=2):
        seen.append((b.specs, b.data.clone(), b.digest))
        ptrs.append(b.data.data_ptr())
    assert len(seen) == len(fresh) >= 4
    for (s1, d1, g1), (s2, d2, g2) in zip(seen, fresh, strict=True):
        assert s1 == s2 and torch.equal(d1, d2) and g1 == g2 == bucket_digest(d1)
    assert ptrs[0] == ptrs[2] and ptrs[1] == ptrs[3] and ptrs[0] != ptrs[1]


class _Work:
    def __init__(self, log, name, error=None):
        self.log, self.name, self.error = log, name, error

    def wait(self):
        self.log.append(self.name)
        if self.error:
            raise self.error


def test_the_send_window_waits_one_bucket_behind_and_charges_a_failure_to_its_key():
    from services.weightsync.nccl.pack import SendWindow

    log, window = [], SendWindow()
    window.add([("s1", _Work(log, "b0/s1")), ("s2", _Work(log, "b0/s2"))])
    assert window.settle() == [] and log == []  # bucket 0 is the newest: still in flight
    window.add([("s1", _Work(log, "b1/s1")), ("s2", _Work(log, "b1/s2", ConnectionError("gone")))])
    assert window.settle() == [] and log == ["b0/s1", "b0/s2"]
    window.add([("s1", _Work(log, "b2/s1"))])
    (failed,) = window.settle()
    assert failed[0] == "s2" and isinstance(failed[1], ConnectionError)
    assert window.drain() == [] and log[-1] == "b2/s1" and window.drain() == []


def test_a_corrupted_bucket_in_the_middle_of_a_pipelined_receive_is_refused_after_the_earlier_ones_in_order():
    from services.weightsync.nccl.receive import BucketReceiver

    named = _many()
    specs = [spec_of(n, t) for n, t in named]
    buckets = list(pack_buckets(named, specs, 100, "cpu"))
    payloads = [b.data.clone() for b in buckets]
    payloads[2][5] ^= 0x40  # altered on the wire, after its digest was declared
    receiver = BucketReceiver(_LoopbackGroup(payloads))
    declared = [(b.specs, b.nbytes) for b in buckets]
    handed = []
    with pytest.raises(WeightSetRejected, match="do not match the digest"):
        for tensors in receiver.receive_all(declared, lambda i: buckets[i].digest):
            handed.append([n for n, _ in tensors])
    assert handed == [[s.name for s in buckets[0].specs], [s.name for s in buckets[1].specs]]


def test_post_hands_back_the_previous_bucket_and_flush_the_last_one_with_a_nan_refused():
    from services.weightsync.nccl.receive import BucketReceiver

    named = _many(4)
    named[3][1][2] = float("nan")
    specs = [spec_of(n, t) for n, t in named]
    buckets = list(pack_buckets(named, specs, 100, "cpu"))
    receiver = BucketReceiver(_LoopbackGroup([b.data for b in buckets]))
    assert len(buckets) == 4
    assert receiver.post(buckets[0].specs, buckets[0].nbytes, buckets[0].digest) is None
    for k in (1, 2, 3):
        earlier = receiver.post(buckets[k].specs, buckets[k].nbytes, buckets[k].digest)
        assert [n for n, _ in earlier] == [f"t{k - 1}"] and torch.equal(earlier[0][1], named[k - 1][1])
    with pytest.raises(WeightSetRejected, match="'t3' holds NaN"):
        receiver.flush()
    assert receiver.flush() == []


def test_a_pipelined_push_over_real_gloo_delivers_every_bucket_in_order(tmp_path):
    import threading

    from services.common.grpc_server import free_port
    from services.weightsync.nccl.group import Group, open_store
    from services.weightsync.nccl.pack import SendWindow
    from services.weightsync.nccl.receive import BucketReceiver

    named = [(f"t{i}", torch.randn(3000 + 97 * i, generator=torch.Generator().manual_seed(i))) for i in range(12)]
    specs = [spec_of(n, t) for n, t in named]
    port = free_port()
    rdv = Rendezvous("127.0.0.1", port, "pipelined", "gloo", 30.0)
    store = open_store("127.0.0.1", port, master=True, timeout_s=30.0)
    got, errors = {}, []

    def receive():
        try:
            group = Group.join(rdv, 1, 2)
            receiver = BucketReceiver(group)
            declared = [(b, sum(s.nbytes for s in b)) for b in plan_buckets(specs, 30000)]
            digest_of = lambda i: group.store.get(f"d/{i}").decode()  # noqa: E731 - the control stream's role
            for tensors in receiver.receive_all(declared, digest_of):
                for n, t in tensors:
                    assert n not in got
                    got[n] = t.clone()
            group.close()
        except Exception as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    group = Group.host(rdv, store)
    window = SendWindow()
    for i, bucket in enumerate(pack_buckets(named, specs, 30000, "cpu", slots=2)):
        group.store.set(f"d/{i}", bucket.digest)
        window.add([(i, group.post(bucket.data))])
        assert window.settle() == []
    assert window.drain() == []
    thread.join(timeout=60)
    group.close()
    assert not errors and i >= 4
    assert list(got) == [n for n, _ in named] and all(torch.equal(got[n], t) for n, t in named)


def test_a_rank_is_refused_at_once_when_asked_to_join_a_group_it_left():
    """Rank 0 forms a group once: a server that left it (for another learner's group, or by a restart) and
    joined it again would wait on it until the timeout."""
    import threading
    import time

    from services.common.grpc_server import free_port
    from services.weightsync.nccl.group import Group, GroupLeft, open_store

    port = free_port()
    rdv = Rendezvous("127.0.0.1", port, "once", "gloo", 30.0)
    store = open_store("127.0.0.1", port, master=True, timeout_s=30.0)
    joined = []
    thread = threading.Thread(target=lambda: joined.append(Group.join(rdv, 1, 2)))
    thread.start()
    host = Group.host(rdv, store)
    thread.join(timeout=30)
    joined[0].close()
    start = time.monotonic()
    with pytest.raises(GroupLeft, match="rank 1 joined and left it before"):
        Group.join(rdv, 1, 2)
    assert time.monotonic() - start < 5
    host.close()


def test_packing_mixed_dtypes_and_strided_tensors_lays_every_tensor_s_bytes_in_order():
    g = torch.Generator().manual_seed(6)
    named = [
        ("flag", torch.tensor([True, False])),  # a bucket of mixed dtypes is copied as bytes
        ("half", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.empty(0, 4)),
        ("ints", torch.arange(7, dtype=torch.int64).reshape(7, 1)),
        ("strided", torch.randn(4, 6, generator=g).T),  # not contiguous
    ]
    specs = [spec_of(n, t) for n, t in named]
    for bucket_bytes in (8, 64, 1 << 20):
        got = {}
        for b in pack_buckets(named, specs, bucket_bytes, "cpu", slots=2):
            assert b.digest == bucket_digest(b.data)
            got.update((n, t.clone()) for n, t in tensor_views(b.specs, b.data))
        assert all(torch.equal(got[n], t) for n, t in named), bucket_bytes


def _fp32_as_bf16(n=9):
    g = torch.Generator().manual_seed(7)
    stored = [(f"w{i}", torch.randn(5, 3 + i, generator=g) * 10.0 ** (i - 4)) for i in range(n)]
    stored[0][1][0, :3] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-9, -(2**-140)])  # ties and a subnormal
    sent = [(n, t.to(torch.bfloat16)) for n, t in stored]
    return stored, sent, [spec_of(n, t) for n, t in sent]


def _bytes(buckets):
    return [(b.specs, b.data.clone(), b.digest) for b in buckets]


def test_fp32_sources_are_cast_into_a_bf16_bucket_as_a_cast_of_each_would_be():
    from services.weightsync.buckets import TensorWeights
    from services.weightsync.nccl.pack import BucketPacker

    stored, sent, specs = _fp32_as_bf16()
    expected = _bytes(pack_buckets(sent, specs, 128, "cpu"))
    assert len(expected) > 2
    for got in (
        _bytes(pack_buckets(stored, specs, 128, "cpu")),
        _bytes(pack_buckets(stored, specs, 128, "cpu", slots=2)),
        _bytes(BucketPacker(128, "cpu").buckets(TensorWeights(specs, lambda: stored, [t for _, t in stored]))),
    ):
        assert [(s, g) for s, _, g in got] == [(s, g) for s, _, g in expected]
        assert all(torch.equal(a, b) for (_, a, _), (_, b, _) in zip(got, expected, strict=True))


@pytest.mark.parametrize(
    "source, spec_dtype",
    [
        (torch.arange(6, dtype=torch.int32), "float32"),  # an int source for a float wire dtype
        (torch.ones(6), "int32"),  # a float source for an int wire dtype
        (torch.ones(6, dtype=torch.bool), "bfloat16"),
        (torch.ones(6, dtype=torch.complex64), "float32"),
    ],
)
def test_a_dtype_other_than_the_spec_s_is_refused_unless_both_are_floating_point(source, spec_dtype):
    from services.weightsync.buckets import TensorWeights
    from services.weightsync.nccl.pack import BucketPacker
    from services.weightsync.wire import TensorSpec, wire_dtype

    spec = TensorSpec("x", spec_dtype, (6,), 6 * wire_dtype(spec_dtype).itemsize)
    with pytest.raises(ValueError, match="expected"):
        list(pack_buckets([("x", source)], [spec], 64, "cpu"))
    with pytest.raises(ValueError, match="expected"):
        list(BucketPacker(64, "cpu").buckets(TensorWeights([spec], lambda: [("x", source)], [source])))


class _Stable:
    """A weight set whose tensors stay put, counting the passes through its (streaming) source."""

    def __init__(self, stored, specs):
        self.stored, self.specs, self.streamed = stored, specs, 0

    def named_tensors(self):
        self.streamed += 1
        return list(self.stored)

    def stable_tensors(self):
        return [t for _, t in self.stored]


def test_the_packer_lays_a_stable_set_out_once_and_again_when_its_specs_or_storage_change():
    from services.weightsync.nccl.pack import BucketPacker

    stored, sent, specs = _fp32_as_bf16()
    packer = BucketPacker(128, "cpu")
    first = _bytes(packer.buckets(_Stable(stored, specs)))
    with torch.no_grad():
        for _, t in stored:
            t.mul_(2.0)  # an optimizer step: in place, the same storage
    weights = _Stable(stored, specs)
    second = _bytes(packer.buckets(weights))
    assert packer.builds == 1 and weights.streamed == 0
    doubled = _bytes(pack_buckets([(n, t.to(torch.bfloat16)) for n, t in stored], specs, 128, "cpu"))
    assert [(s, g) for s, _, g in second] == [(s, g) for s, _, g in doubled] != [(s, g) for s, _, g in first]

    fewer = _Stable(stored[1:], specs[1:])  # another set: laid out anew
    list(packer.buckets(fewer))
    assert packer.builds == 2
    stored[3] = (stored[3][0], stored[3][1].clone())  # a tensor replaced by new storage
    list(packer.buckets(_Stable(stored, specs)))
    assert packer.builds == 3
    list(packer.buckets(_Stable(stored, specs)))
    assert packer.builds == 3


def test_a_set_the_packer_cannot_lay_out_streams_and_comes_out_the_same():
    from services.weightsync.nccl.pack import BucketPacker

    g = torch.Generator().manual_seed(8)
    strided = [("s", torch.randn(4, 6, generator=g).T), ("t", torch.randn(3, generator=g))]
    mixed_cast = [("f", torch.randn(3, generator=g)), ("i", torch.arange(4))]  # f: fp32 sent as bf16
    mixed_specs = [spec_of("f", mixed_cast[0][1].to(torch.bfloat16)), spec_of("i", mixed_cast[1][1])]
    for stored, specs in ((strided, [spec_of(n, t) for n, t in strided]), (mixed_cast, mixed_specs)):
        packer, weights = BucketPacker(1 << 20, "cpu"), _Stable(stored, specs)
        got = _bytes(packer.buckets(weights))
        assert weights.streamed == 1
        expected = _bytes(pack_buckets(stored, specs, 1 << 20, "cpu"))
        assert [(s, g) for s, _, g in got] == [(s, g) for s, _, g in expected]
        list(packer.buckets(_Stable(stored, specs)))
        assert packer.builds == 1  # found not to fit once, not re-examined


def test_the_receiver_reuses_its_views_on_the_next_push_and_still_refuses_a_corrupted_bucket(monkeypatch):
    from services.weightsync.nccl import receive
    from services.weightsync.nccl.receive import BucketReceiver, ParamCopier

    named = _many()
    specs = [spec_of(n, t) for n, t in named]
    buckets = list(pack_buckets(named, specs, 100, "cpu"))
    declared = [(b.specs, b.nbytes) for b in buckets]
    made = []
    monkeypatch.setattr(receive, "tensor_views", lambda *a: made.append(a[0]) or tensor_views(*a))
    group = _LoopbackGroup([b.data for b in buckets] * 2)
    receiver = BucketReceiver(group)
    params = {n: torch.zeros_like(t) for n, t in named}
    copy = ParamCopier(params)
    pushes = []
    for _ in range(2):
        handed = []
        for tensors in receiver.receive_all(declared, lambda i: buckets[i].digest):
            handed.append([(n, t.data_ptr(), t.shape) for n, t in tensors])
            copy(tensors)
        assert all(torch.equal(params[n], t) for n, t in named)
        for t in params.values():
            t.zero_()
        pushes.append(handed)
    assert len(buckets) % 2 == 0 and len(made) == len(buckets)  # the second push made no view
    assert pushes[0] == pushes[1]

    payloads = [b.data.clone() for b in buckets]
    payloads[1][3] ^= 0x10
    group.payloads = payloads
    got = []
    with pytest.raises(WeightSetRejected, match="do not match the digest"):
        for tensors in receiver.receive_all(declared, lambda i: buckets[i].digest):
            got.append([n for n, _ in tensors])
    assert got == [[s.name for s in buckets[0].specs]]  # nothing of the corrupted bucket was handed out


def test_the_receiver_makes_new_views_for_other_specs_of_the_same_size():
    from services.weightsync.nccl.receive import BucketReceiver
    from services.weightsync.wire import TensorSpec

    data = torch.arange(12, dtype=torch.float32)
    specs_a = (TensorSpec("a", "float32", (12,), 48),)
    specs_b = (TensorSpec("a", "float32", (3, 4), 48),)
    digest = bucket_digest(data.view(torch.uint8))
    receiver = BucketReceiver(_LoopbackGroup([data.view(torch.uint8)] * 4))
    for specs in (specs_a, specs_a, specs_b, specs_b):  # slot 0, 1, 0, 1
        ((name, t),) = receiver.receive(specs, 48, digest)
        assert name == "a" and t.shape == specs[0].shape and torch.equal(t.reshape(-1), data)
