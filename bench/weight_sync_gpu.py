"""Weight sync over a process group (the `nccl` push's data plane), without vLLM: a learner process on
GPU0 holds a random-weight bf16 model sharded with FSDP2 (as the learner does, a world of one) and
pushes it through the sender's code (`fsdp.streamed_weights` -> `weight_dist.pack_buckets` with each
bucket's on-device digest -> `Group.broadcast`); a receiver process on GPU1 takes each bucket through
the shared receiving code (`weight_dist.BucketReceiver.receive_all`: broadcast into one of two
buffers, the next bucket's transfer overlapping the digest and finite checks of this one) and copies
it into a Hugging Face model's named parameters (`check_against` first, then `copy_into`). In the same
run, the same two processes time a raw broadcast of buffers of the same bucket sizes: the ceiling the
push is compared against.

Per shape: seconds per full sync (median of --repeats, each ended by an all-reduce after the receiver
applied and synchronized), GB/s, % of the raw broadcast bandwidth, and the GPUs. The per-bucket
digests go to the receiver through the rendezvous store (the gRPC control stream's role in a real push).

    python bench/weight_sync_gpu.py --out $OUT/weight_sync_gpu.json             # 2 GPUs, 0.5b and 7b
    python bench/weight_sync_gpu.py --device cpu --shapes tiny                   # gloo, on CPU
"""

from __future__ import annotations

import argparse
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


def _model(shape: str, device):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**{**SHAPES[shape], "max_position_embeddings": 4096})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
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


def _sender(args, port, shape, gpu, results) -> None:
    import torch

    from services.common.weight_buckets import plan_buckets
    from services.common.weight_dist import Group, Rendezvous, open_store, pack_buckets
    from services.learner import fsdp

    device = torch.device(f"cuda:{gpu}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    fsdp.init_distributed(device)  # FSDP's own world of one, as a one-process learner has
    model = fsdp.shard_model(_model(shape, device), device)
    weights = fsdp.streamed_weights(model, torch.bfloat16)
    total = sum(s.nbytes for s in weights.specs)
    bucket_bytes = args.bucket_mb << 20
    sizes = [sum(s.nbytes for s in b) for b in plan_buckets(weights.specs, bucket_bytes)]

    store = open_store("127.0.0.1", port, master=True, timeout_s=args.timeout_s)
    rdv = Rendezvous("127.0.0.1", port, f"bench-{shape}", "nccl" if device.type == "cuda" else "gloo", args.timeout_s)
    group = Group.host(rdv, store)
    group.store.set("specs", json.dumps([[s.name, s.dtype, list(s.shape), s.nbytes] for s in weights.specs]))

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
    for i in range(args.repeats + 1):
        _barrier(group, device)
        start = time.perf_counter()
        for b, bucket in enumerate(pack_buckets(weights.named_tensors(), weights.specs, bucket_bytes, device)):
            group.store.set(f"digest/{i}/{b}", bucket.digest)
            group.broadcast(bucket.data)
        _barrier(group, device)  # the receiver applied every bucket and synchronized
        if i:
            sync_times.append(time.perf_counter() - start)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results.put(
        dict(
            role="sender",
            shape=shape,
            device=str(device),
            gpu_name=name,
            bytes=total,
            buckets=len(sizes),
            bucket_mb=args.bucket_mb,
            tensors=len(weights.specs),
            raw_broadcast_s=raw_times,
            sync_s=sync_times,
        )
    )
    group.close()
    torch.distributed.destroy_process_group()


def _digest_of(group, sync: int, bucket: int) -> str:
    return group.store.get(f"digest/{sync}/{bucket}").decode()


def _receiver(args, port, shape, gpu, results) -> None:
    import torch

    from services.common.weight_buckets import plan_buckets
    from services.common.weight_dist import BucketReceiver, Group, Rendezvous, check_against, copy_into
    from services.common.weights import TensorSpec

    device = torch.device(f"cuda:{gpu}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = _model(shape, device)
    params = model.state_dict()
    rdv = Rendezvous("127.0.0.1", port, f"bench-{shape}", "nccl" if device.type == "cuda" else "gloo", args.timeout_s)
    group = Group.join(rdv, 1, 2)
    specs = [TensorSpec(n, d, tuple(s), b) for n, d, s, b in json.loads(group.store.get("specs"))]
    check_against(params, specs)  # names, dtypes, shapes against the model before any data moves
    plan = plan_buckets(specs, args.bucket_mb << 20)
    sizes = [sum(s.nbytes for s in b) for b in plan]

    raw = torch.empty(max(sizes), dtype=torch.uint8, device=device)
    for _ in range(args.repeats + 1):
        _barrier(group, device)
        for n in sizes:
            group.broadcast(raw[:n])
        _barrier(group, device)
    del raw
    receiver = BucketReceiver(group)
    for i in range(args.repeats + 1):
        _barrier(group, device)
        declared = [(bucket_specs, sum(s.nbytes for s in bucket_specs)) for bucket_specs in plan]
        digest_of = functools.partial(_digest_of, group, i)  # the control stream's role
        for tensors in receiver.receive_all(declared, digest_of):
            copy_into(params, tensors)
        _sync(device)
        _barrier(group, device)
    probe = next(iter(params.values()))
    finite = bool(probe.float().isfinite().all())
    results.put(dict(role="receiver", shape=shape, device=str(device), probe_finite=finite))
    receiver.release()
    group.close()


def run_shape(args, shape: str) -> dict:
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
    deadline = time.monotonic() + args.shape_timeout_s
    while len(got) < 2 and time.monotonic() < deadline:
        try:
            r = results.get(timeout=1.0)
            got[r["role"]] = r
        except Exception:  # noqa: BLE001 - queue.Empty: check the children
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if len(got) < 2:
        raise RuntimeError(f"{shape}: a process failed (exit codes {[p.exitcode for p in procs]})")
    s = got["sender"]
    sync = statistics.median(s["sync_s"])
    raw = statistics.median(s["raw_broadcast_s"])
    return dict(
        shape=shape,
        sender_device=s["device"],
        receiver_device=got["receiver"]["device"],
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
        receiver_weights_finite=got["receiver"]["probe_finite"],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cuda: nccl on GPU0->GPU1; cpu: gloo")
    ap.add_argument("--shapes", default="0.5b,7b", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
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
        rows.append(run_shape(args, shape))
        r = rows[-1]
        print(
            f"{r['shape']:>5} {r['gigabytes']:7.3f} GB {r['buckets']:4d} buckets  sync {r['sync_s_median']:.3f}s "
            f"{r['sync_gb_s']:7.2f} GB/s   raw broadcast {r['raw_broadcast_s_median']:.3f}s {r['raw_gb_s']:7.2f} GB/s  "
            f"{r['pct_of_raw']:5.1f}% of raw   [{r['gpu']}: {r['sender_device']} -> {r['receiver_device']}]",
            flush=True,
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
