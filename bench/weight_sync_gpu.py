"""Weight sync over a process group (the `nccl` push's data plane), without vLLM: a learner process on GPU0
holds a random-weight model (bf16, or fp32 master weights with `--learner-dtype float32`; sent as bf16
either way) sharded with FSDP2 (as the learner does, a world of one) and pushes it through the sender's code
(`full_weights.streamed_weights` -> `nccl.pack.BucketPacker`, kept across pushes as the pusher keeps it ->
`Group.post` through a `SendWindow`, then the bucket's on-device digest while it moves, sent after it, as
`nccl.send._stream` does with `digests_follow`); a receiver process on GPU1 takes each bucket through the
shared receiving code (`BucketReceiver`) and copies it into a Hugging Face model's named parameters
(`check_against` first, then a `ParamCopier`, kept across pushes: each bucket's parameter list looked up
once). In the same run, the same two processes time a raw broadcast of buffers of the same bucket sizes: the
ceiling the push is compared against.

Modes (`--modes`): `pipelined`, the push's path: two buffers a side; the sender digests bucket k and packs
bucket k+1 while bucket k is on the wire, the receiver checks (digest and finite sum, one read back) and applies
bucket k while bucket k+1 arrives (`BucketReceiver.receive_all`, the vLLM worker's `post`/`flush`).
`serial`: one bucket at a time (pack, send and digest, then receive, check, apply: `BucketReceiver.receive`).
`staged`: the vLLM worker's path, which a Hugging Face receiver can follow without vLLM: each checked bucket
is staged in a host spool file (`nccl.staging.BucketStager`), every write waited for, then each bucket is
mapped from the spool and copied into the model, as the commit's apply does (its seconds reported apart).
`staged-plain`: the same with the worker's staging before `BucketStager` (a synchronous pageable copy and
one write a bucket), for comparison in the same run. `staged-memory`: staged in a pinned host arena instead
of the file (`rollout.weight_staging: memory`), applied from it.

Per shape, bucket size and mode: seconds per full sync (median of --repeats, each ended by an all-reduce
after the receiver applied and synchronized), GB/s, % of the raw broadcast bandwidth, the GPUs, and two
phases timed alone (no transfer), each with its host CPU seconds (`time.process_time`): the sender's
pack + digest of every bucket, the receiver's check + apply of every bucket (through the same receiver,
over buckets left zeroed). The per-bucket digests go to the receiver through the rendezvous store (the gRPC
control stream's role in a real push).

    bash bench/weight_sync_gpu.sh --modes pipelined,serial          # 2 GPUs: 0.5b and 7b, 256 MB and 1 GB
    python bench/weight_sync_gpu.py --device cpu --shapes tiny --bucket-mb 0.02,0.1 --modes pipelined,serial
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.learner_step import SHAPES  # noqa: E402  (its top needs nothing beyond the standard library)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(shape: str, device, dtype: str = "bfloat16"):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**{**SHAPES[shape], "max_position_embeddings": 4096})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    return model.eval()


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(group, device) -> None:
    import torch

    flag = torch.ones(1, device=device)
    group.pg.allreduce([flag]).wait()
    _sync(device)


def _combos(args) -> list[tuple[int, str]]:
    return [(float(mb), mode) for mb in str(args.bucket_mb).split(",") for mode in args.modes.split(",")]


def _sender(args, port, shape, gpu, results) -> None:
    import torch

    from services.learner import collectives, full_weights, parallelize
    from services.weightsync.buckets import plan_buckets
    from services.weightsync.digest import bucket_digest
    from services.weightsync.nccl.group import Group, Rendezvous, open_store
    from services.weightsync.nccl.pack import BucketPacker, SendWindow

    device = torch.device(f"cuda:{gpu}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    collectives.init_distributed(device)  # FSDP's own world of one, as a one-process learner has
    model = parallelize.shard_model(_model(shape, device, args.learner_dtype), device)
    weights = full_weights.streamed_weights(model, torch.bfloat16)
    total = sum(s.nbytes for s in weights.specs)

    store = open_store("127.0.0.1", port, master=True, timeout_s=args.timeout_s)
    rdv = Rendezvous("127.0.0.1", port, f"bench-{shape}", "nccl" if device.type == "cuda" else "gloo", args.timeout_s)
    group = Group.host(rdv, store)
    group.store.set("specs", json.dumps([[s.name, s.dtype, list(s.shape), s.nbytes] for s in weights.specs]))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    for c, (bucket_mb, mode) in enumerate(_combos(args)):
        bucket_bytes = int(bucket_mb * 2**20)
        sizes = [sum(s.nbytes for s in b) for b in plan_buckets(weights.specs, bucket_bytes)]
        raw = torch.empty(max(sizes), dtype=torch.uint8, device=device)
        raw_times, sync_times = [], []
        for i in range(args.repeats + 1):  # the first of each is a warm-up (communicator set-up, allocations)
            _barrier(group, device)
            start = time.perf_counter()
            for n in sizes:
                group.broadcast(raw[:n])
            _barrier(group, device)
            if i:
                raw_times.append(time.perf_counter() - start)
        del raw
        if mode not in ("pipelined", "serial", *STAGED):
            raise ValueError(f"unknown mode {mode!r}")
        pipelined = mode != "serial"
        # kept across pushes as the nccl pusher keeps one (its layout of a one-process learner's set)
        packers = {p: BucketPacker(bucket_bytes, device, slots=2 if p else None) for p in (False, True)}
        for i in range(args.repeats + 2):  # the last one is traced with --trace-dir (not timed)
            traced = i == args.repeats + 1
            if traced and not args.trace_dir:
                break
            with _tracing(traced, args.trace_dir, f"{shape}_c{c}_sender"):
                _barrier(group, device)
                start = time.perf_counter()
                window = SendWindow()  # the pusher's loop (`nccl.send._stream`) for one group
                buckets = packers[pipelined].buckets(weights, digest=False)
                for b, bucket in enumerate(buckets):
                    posted = group.post(bucket.data)  # digested while it moves; the digest follows it
                    group.store.set(f"digest/{c}/{i}/{b}", bucket_digest(bucket.data))
                    window.add([(b, posted)])
                    if failed := window.settle() if pipelined else window.drain():
                        raise RuntimeError(f"broadcast failed: {failed}")
                if failed := window.drain():
                    raise RuntimeError(f"broadcast failed: {failed}")
                _barrier(group, device)  # the receiver applied every bucket and synchronized
            if i and not traced:
                sync_times.append(time.perf_counter() - start)
        # phase: the sender's pack + digest alone (no transfer), as the pipelined push packs
        pack_times, pack_cpu = [], []
        for _ in range(3):
            _sync(device)
            start, cpu = time.perf_counter(), time.process_time()
            for _bucket in packers[True].buckets(weights):
                pass
            _sync(device)
            pack_times.append(time.perf_counter() - start)
            pack_cpu.append(time.process_time() - cpu)
        results.put(
            dict(
                role="sender",
                combo=c,
                shape=shape,
                mode=mode,
                device=str(device),
                gpu_name=name,
                bytes=total,
                buckets=len(sizes),
                bucket_mb=bucket_mb,
                tensors=len(weights.specs),
                raw_broadcast_s=raw_times,
                sync_s=sync_times,
                pack_digest_s=min(pack_times),
                pack_digest_cpu_s=min(pack_cpu),
                layouts_built=packers[True].builds,
            )
        )
        _barrier(group, device)
    group.close()
    torch.distributed.destroy_process_group()


def _digest_of(group, combo: int, sync: int, bucket: int) -> str:
    return group.store.get(f"digest/{combo}/{sync}/{bucket}").decode()


def _receiver(args, port, shape, gpu, results) -> None:
    import torch

    from services.weightsync.buckets import plan_buckets
    from services.weightsync.digest import bucket_digest
    from services.weightsync.nccl.group import Group, Rendezvous
    from services.weightsync.nccl.receive import BucketReceiver, ParamCopier, check_against
    from services.weightsync.wire import TensorSpec

    device = torch.device(f"cuda:{gpu}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = _model(shape, device)
    params = model.state_dict()
    rdv = Rendezvous("127.0.0.1", port, f"bench-{shape}", "nccl" if device.type == "cuda" else "gloo", args.timeout_s)
    group = Group.join(rdv, 1, 2)
    specs = [TensorSpec(n, d, tuple(s), b) for n, d, s, b in json.loads(group.store.get("specs"))]
    check_against(params, specs)  # names, dtypes, shapes against the model before any data moves
    copy_into = ParamCopier(params)  # kept across pushes, as a receiver keeps its model
    for c, (bucket_mb, mode) in enumerate(_combos(args)):
        plan = plan_buckets(specs, int(bucket_mb * 2**20))
        sizes = [sum(s.nbytes for s in b) for b in plan]
        raw = torch.empty(max(sizes), dtype=torch.uint8, device=device)
        for _ in range(args.repeats + 1):
            _barrier(group, device)
            for n in sizes:
                group.broadcast(raw[:n])
            _barrier(group, device)
        del raw
        receiver = BucketReceiver(group)
        apply_times = []
        for i in range(args.repeats + 2):
            traced = i == args.repeats + 1
            if traced and not args.trace_dir:
                break
            with _tracing(traced, args.trace_dir, f"{shape}_c{c}_receiver"):
                _barrier(group, device)
                declared = [(bucket_specs, sum(s.nbytes for s in bucket_specs)) for bucket_specs in plan]
                digest_of = functools.partial(_digest_of, group, c, i)  # the control stream's role
                if mode == "pipelined":  # the vLLM worker's post/flush
                    for tensors in receiver.receive_all(declared, digest_of):
                        copy_into(tensors)
                elif mode in STAGED:  # the vLLM worker's post/flush, staging into a spool, then the commit's apply
                    apply_times.append(_staged_sync(receiver, declared, digest_of, copy_into, args, mode))
                else:  # one bucket at a time
                    for b, (bucket_specs, nbytes) in enumerate(declared):
                        copy_into(receiver.receive(bucket_specs, nbytes, digest_of(b)))
                _sync(device)
                _barrier(group, device)
        probe = next(iter(params.values()))
        finite = bool(probe.float().isfinite().all())
        # phase: the receiver's checks (digest + finite, one read back) and apply alone, through the same
        # receiver over zeroed buckets (the untimed passes zero them; the model's values do not matter to the
        # next syncs)
        zero_digests = [bucket_digest(torch.zeros(n, dtype=torch.uint8, device=device)) for n in sizes]
        receiver.group = _Replay(group)
        check_times, check_cpu = [], []
        for i in range(5):  # two untimed passes zero both slots at every size (an odd count swaps them a pass)
            receiver.group.zero = i < 2
            _sync(device)
            start, cpu = time.perf_counter(), time.process_time()
            for tensors in receiver.receive_all(declared, zero_digests.__getitem__):
                copy_into(tensors)
            _sync(device)
            if i >= 2:
                check_times.append(time.perf_counter() - start)
                check_cpu.append(time.process_time() - cpu)
        receiver.release()
        results.put(
            dict(
                role="receiver",
                combo=c,
                device=str(device),
                probe_finite=finite,
                check_apply_s=min(check_times),
                check_apply_cpu_s=min(check_cpu),
                apply_from_spool_s=apply_times[1:-1] if args.trace_dir else apply_times[1:],
            )
        )
        _barrier(group, device)
    group.close()


STAGED = ("staged", "staged-plain", "staged-memory")


def _staged_sync(receiver, declared, digest_of, copy_into, args, mode: str) -> float:
    """One push as the vLLM worker takes it: each checked bucket staged at its page-aligned spool offset
    (`staged`: into the spool file through `BucketStager`, pinned buffers and a writer thread; `staged-plain`:
    the worker's earlier synchronous pageable copy and write; `staged-memory`: into a pinned `HostArena`, as
    `rollout.weight_staging: memory` does), every copy or write waited for, then the commit's apply: each
    bucket mapped from the spool (or viewed in the arena) and copied into the model. Returns the apply's
    seconds. The arena is kept across pushes as the worker keeps it (`args.arena`)."""
    import tempfile

    import torch

    from services.weightsync.nccl.staging import BucketStager, HostArena, write_at
    from services.weightsync.spool import PAGE, mapped_bucket

    offsets, at = [], 0
    for _specs, nbytes in declared:
        at += -at % PAGE
        offsets.append(at)
        at += nbytes
    fd, path = tempfile.mkstemp(prefix="omrl-bench-", suffix=".spool", dir=args.stage_dir or None)
    os.close(fd)
    stager = BucketStager() if mode == "staged" else None
    if mode == "staged-memory":
        if getattr(args, "arena", None) is None:
            args.arena = HostArena()
        stager = args.arena
        stager.begin(HostArena.span(at, len(declared)), pinned=torch.cuda.is_available())
    try:
        for b, _tensors in enumerate(receiver.receive_all(declared, digest_of)):
            if stager is not None:
                stager.stage(path, offsets[b], receiver.last)
            else:
                write_at(path, offsets[b], receiver.last.cpu().numpy())
        if stager is not None:
            stager.drain()
        start = time.perf_counter()
        for (specs, _nbytes), offset in zip(declared, offsets, strict=True):
            if mode == "staged-memory":
                copy_into(stager.tensors(path, offset, specs))
                continue
            with mapped_bucket(path, offset, specs) as tensors:
                copy_into(tensors)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start
    finally:
        if isinstance(stager, BucketStager):
            stager.close()
        os.unlink(path)


@contextlib.contextmanager
def _tracing(on: bool, trace_dir: str, name: str):
    """A torch.profiler trace (CPU and CUDA activity) of the block, written to `trace_dir/name.json`."""
    if not on:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(Path(trace_dir) / f"{name}.json"))


class _Replay:
    """A stand-in group for the receiver's phase timed alone: a "broadcast" leaves the buffer as it is
    (zeroed while `zero` is set)."""

    class _Done:
        def wait(self):
            pass

    def __init__(self, group):
        self.rdv, self.zero = group.rdv, False

    def post(self, buffer):
        if self.zero:
            buffer.zero_()
        return self._Done()


def run_shape(args, shape: str) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_sender, args=(args, port, shape, 0, results)),
        ctx.Process(target=_receiver, args=(args, port, shape, 1, results)),
    ]
    for p in procs:
        p.start()
    got = {}
    want = 2 * len(_combos(args))
    deadline = time.monotonic() + args.shape_timeout_s
    while len(got) < want and time.monotonic() < deadline:
        try:
            r = results.get(timeout=1.0)
            got[r["role"], r["combo"]] = r
        except Exception:  # noqa: BLE001 - queue.Empty: check the children
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    rows = []
    for c in range(len(_combos(args))):
        if ("sender", c) not in got or ("receiver", c) not in got:
            continue
        s, r = got["sender", c], got["receiver", c]
        sync = statistics.median(s["sync_s"])
        raw = statistics.median(s["raw_broadcast_s"])
        rows.append(
            dict(
                shape=shape,
                mode=s["mode"],
                sender_device=s["device"],
                receiver_device=r["device"],
                gpu=s["gpu_name"],
                gigabytes=s["bytes"] / 1e9,
                tensors=s["tensors"],
                buckets=s["buckets"],
                bucket_mb=s["bucket_mb"],
                sync_s_median=sync,
                sync_s=s["sync_s"],
                sync_gb_s=s["bytes"] / sync / 1e9,
                raw_broadcast_s_median=raw,
                raw_broadcast_s=s["raw_broadcast_s"],
                raw_gb_s=s["bytes"] / raw / 1e9,
                pct_of_raw=100.0 * raw / sync,
                learner_dtype=args.learner_dtype,
                sender_pack_digest_s=s["pack_digest_s"],
                sender_pack_digest_cpu_s=s["pack_digest_cpu_s"],
                sender_layouts_built=s["layouts_built"],
                receiver_check_apply_s=r["check_apply_s"],
                receiver_check_apply_cpu_s=r["check_apply_cpu_s"],
                receiver_weights_finite=r["probe_finite"],
                apply_from_spool_s_median=statistics.median(r["apply_from_spool_s"] or [0.0]) or None,
            )
        )
    if len(rows) < len(_combos(args)):
        print(f"{shape}: a process failed (exit codes {[p.exitcode for p in procs]}); {len(rows)} rows", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cuda: nccl on GPU0->GPU1; cpu: gloo")
    ap.add_argument("--shapes", default="0.5b,7b", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--bucket-mb", default="256,1024", help="comma-separated bucket sizes (MiB), each run in turn")
    ap.add_argument(
        "--modes",
        default="pipelined",
        help="comma-separated: pipelined (the push's path: two buffers a side, bucket k+1 packed and bucket k-1 "
        "checked while bucket k moves), serial (one bucket at a time: pack, send, check, apply), staged (the vLLM "
        "worker's path: each checked bucket staged in a host spool file, then applied from it as a commit does) "
        "staged-plain (the same with the worker's earlier staging: a synchronous pageable copy and write) and "
        "staged-memory (staged in a pinned host arena, rollout.weight_staging: memory)",
    )
    ap.add_argument("--stage-dir", default="", help="where the staged modes' spool files go (default: the temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trace-dir", default="", help="write a profiler trace of one more sync per row and side here")
    ap.add_argument(
        "--learner-dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="the sender's model dtype (sent as bf16 either way): float32 is a learner's fp32 master weights",
    )
    ap.add_argument("--timeout-s", type=float, default=120.0, help="group formation and each broadcast")
    ap.add_argument("--shape-timeout-s", type=float, default=240.0)
    out = os.path.join(os.environ["OUT"], "weight_sync_gpu.json") if os.environ.get("OUT") else ""
    ap.add_argument("--out", default=out, help="JSON results (default: $OUT/weight_sync_gpu.json)")
    args = ap.parse_args()
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            raise SystemExit(f"needs 2 GPUs, sees {torch.cuda.device_count()}")
    rows = []
    for shape in args.shapes.split(","):
        for r in run_shape(args, shape):
            rows.append(r)
            print(
                f"{r['shape']:>5} {r['mode']:>9} {r['gigabytes']:7.3f} GB {r['buckets']:4d} x {r['bucket_mb']:g} MB  "
                f"sync {r['sync_s_median']:.4f}s {r['sync_gb_s']:7.2f} GB/s  raw {r['raw_broadcast_s_median']:.4f}s "
                f"{r['raw_gb_s']:7.2f} GB/s  {r['pct_of_raw']:5.1f}% of raw  "
                f"pack+digest {r['sender_pack_digest_s']:.4f}s (cpu {r['sender_pack_digest_cpu_s']:.4f}s) "
                f"check+apply {r['receiver_check_apply_s']:.4f}s (cpu {r['receiver_check_apply_cpu_s']:.4f}s)  "
                + (f"commit's apply from spool {spool:.4f}s  " if (spool := r["apply_from_spool_s_median"]) else "")
                + f"[{r['gpu']}: {r['sender_device']} -> "
                f"{r['receiver_device']}]",
                flush=True,
            )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
