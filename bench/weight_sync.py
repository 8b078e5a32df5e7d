"""Weight sync on CPU: a learner process pushes a perturbed copy of the served model to a rollout side
(vLLM on CPU behind RolloutCore and the gRPC server, in this process) over the bucketed gRPC push
(`--transport grpc`) or the process-group push (`--transport nccl`: gloo on CPU, the bytes broadcast
to the engine's worker, the control on the gRPC stream).

Per push: wall time, the rollout's apply time (from its reply; transfer = wall - apply), bytes/s, and
peak RSS above the state before the push on each side (the learner process; this process with its
vLLM children). Measured in the same run: loopback TCP bandwidth (a child process reading a socket)
and vLLM's own `reload_weights` over the same tensors, timed inside the worker, with the rollout side's
extra RSS meanwhile. `--spool-dir` puts the rollout's spool elsewhere than the temp folder.
`atomic_push_floor_vs_reload_weights`: the least a push that applies nothing before its last byte is checked
could take, over `reload_weights` (the set moved at the full loopback rate, then applied in `reload_weights`'
own time), whatever the transport.

    python bench/weight_sync.py --model tiny --out tiny.json
    python bench/weight_sync.py --model 85m --bucket-mb 64 --out 85m.json
    python bench/weight_sync.py --model 85m --transport nccl --out 85m_nccl.json   # gloo process group
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    "tiny": None,  # services.common.tiny_model.MODEL_SHAPE
    "85m": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        head_dim=64,
        intermediate_size=2048,
        max_position_embeddings=1024,
    ),
}
CORPUS = [f"You are in cell {i}. The exit is to the {'left' if i % 2 else 'right'}." for i in range(30)]


class PeakRss:
    """Samples the summed RSS of `pids()` every few ms; `peak - base` is the extra memory."""

    def __init__(self, pids, every_s: float = 0.005):
        self.pids, self.every_s, self.peak = pids, every_s, 0
        self.base = self._now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _now(self) -> int:
        import psutil

        total = 0
        for pid in self.pids():
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._now())
            time.sleep(self.every_s)

    def __enter__(self):
        self.peak = self.base
        self._thread.start()
        return self

    def __exit__(self, *_):
        self._stop.set()
        self._thread.join()

    @property
    def extra(self) -> int:
        return self.peak - self.base


def perturbed_weights(model_dir: str, seed: int):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return list(model.state_dict().items())


def learner(args) -> None:
    """The pushing side (its own process): load, perturb, push once, report."""
    # everything the push imports (grpc, the protos, torch.distributed) loads here, before the baseline
    from services.weightsync.buckets import TensorWeights
    from services.weightsync.grpc.send import GrpcWeightPusher
    from services.weightsync.nccl.send import NcclWeightPusher

    named = perturbed_weights(args.model_dir, args.seed)
    weights = TensorWeights.of(named)
    if args.transport == "nccl":  # gloo on CPU; the rendezvous store on a free port of this host
        pusher = NcclWeightPusher(
            timeout_s=600, token="bench", bucket_mb=args.bucket_mb, host="127.0.0.1", port=free_port()
        )
    else:
        pusher = GrpcWeightPusher(timeout_s=600, token="bench", bucket_mb=args.bucket_mb)
    with PeakRss(lambda: [os.getpid()]) as rss:
        start = time.perf_counter()
        (result,) = pusher.push(args.version, weights, [args.address])
        seconds = time.perf_counter() - start
    model_bytes = sum(s.nbytes for s in weights.specs)
    print(
        json.dumps(
            {
                "ok": result.ok,
                "error": result.error,
                "seconds": seconds,
                "extra_rss": rss.extra,
                "model_bytes": model_bytes,
            }
        )
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_tcp_bytes_per_s(total: int = 1 << 30, chunk: int = 4 << 20) -> float:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket,sys\n"
            f"s=socket.create_connection(('127.0.0.1',{port}))\n"
            "b=bytearray(4<<20);v=memoryview(b);n=0\n"
            "while True:\n"
            "    k=s.recv_into(v)\n"
            "    if not k: break\n"
            "    n+=k\n"
            "print(n)",
        ],
        stdout=subprocess.PIPE,
    )
    conn, _ = server.accept()
    data = b"\0" * chunk
    start = time.perf_counter()
    for _ in range(total // chunk):
        conn.sendall(data)
    conn.close()
    received = int(reader.communicate(timeout=120)[0])
    seconds = time.perf_counter() - start
    server.close()
    assert received == total
    return total / seconds


async def rollout_side(args, model_dir: Path) -> dict:
    import psutil

    from services.common.grpc_server import serve
    from services.engines.vllm import VllmBackend
    from services.rollout.core import RolloutCore
    from services.rollout.server import add_to_server
    from services.weightsync.buckets import TensorWeights
    from services.weightsync.credential import PushAuthenticator
    from services.weightsync.spool import SpoolWriter
    from services.weightsync.wire import ModelSignature

    spool_dir = tempfile.mkdtemp(prefix="omrl-bench-spool-", dir=args.spool_dir or None)
    backend = VllmBackend(str(model_dir), gpu_memory_utilization=0.02)
    await backend.start()
    signature = ModelSignature.of_pretrained(str(model_dir), "float32")
    core = RolloutCore(backend, str(model_dir), signature=signature, spool_dir=spool_dir)
    stop, bound = asyncio.Event(), asyncio.get_running_loop().create_future()
    server = asyncio.ensure_future(
        serve(
            "rollout",
            0,
            [add_to_server(core, PushAuthenticator("bench"))],
            host="127.0.0.1",
            stop=stop,
            ready=bound.set_result,
        )
    )
    port = await bound
    me = psutil.Process()

    learner_pid = [0]

    def pids():  # this process and its vLLM children, not the learner
        return [me.pid] + [c.pid for c in me.children(recursive=True) if c.pid != learner_pid[0]]

    pushes = []
    try:
        for i in range(args.pushes):
            cmd = [sys.executable, __file__, "--learner", "--model-dir", str(model_dir), "--address"]
            cmd += [f"127.0.0.1:{port}", "--version", str(i + 1), "--seed", str(i), "--bucket-mb", str(args.bucket_mb)]
            cmd += ["--transport", args.transport]
            proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, env=os.environ.copy())
            learner_pid[0] = proc.pid
            with PeakRss(pids) as rss:
                out, _ = await proc.communicate()
            report = json.loads(out.decode().strip().splitlines()[-1])
            status = core.status()
            assert report["ok"] and status["policy_version"] == i + 1, report
            pushes.append({**report, "apply_seconds": core_last_apply(core), "rollout_extra_rss": rss.extra})
        named = perturbed_weights(str(model_dir), 99)
        with SpoolWriter(spool_dir) as writer:
            for bucket in TensorWeights.of(named).buckets(args.bucket_mb << 20):
                writer.add(bucket.specs, bucket.data)
        spool = writer.finish()
        del named
        infos = [b.to_info(spool.path) for b in spool.buckets]
        reloads, reload_rss = [], []
        for _ in range(args.pushes):
            with PeakRss(pids) as rss:
                (seconds,) = await backend.engine.collective_rpc("reload_spool_timed", args=(infos,))
            reloads.append(seconds)
            reload_rss.append(rss.extra)
        spool.delete()
    finally:
        stop.set()
        await server
        await backend.shutdown()
    return {"pushes": pushes, "reload_weights_seconds": reloads, "reload_weights_extra_rss": reload_rss}


_APPLY: list[float] = []


def core_last_apply(core) -> float:
    return _APPLY[-1] if _APPLY else float("nan")


def instrument_apply() -> None:
    """Records the apply time of each push (the same figure the reply carries to the learner)."""
    from services.rollout import core as core_module

    original = core_module.RolloutCore._apply

    async def timed(self, header, spool):
        result = await original(self, header, spool)
        _APPLY.append(result.apply_seconds)
        return result

    core_module.RolloutCore._apply = timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--transport", choices=["grpc", "nccl"], default="grpc")
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--spool-dir", default="", help="where the rollout side spools (default: the temp folder)")
    ap.add_argument("--out", default="")
    ap.add_argument("--learner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--address", default="", help=argparse.SUPPRESS)
    ap.add_argument("--version", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.learner:
        return learner(args)

    from services.common import tiny_model

    if SHAPES[args.model]:
        tiny_model.MODEL_SHAPE = SHAPES[args.model]
    model_dir = tiny_model.build_tiny_model(Path(tempfile.mkdtemp(prefix="omrl-bench-model-")), CORPUS)
    load_start = os.getloadavg()
    tcp = [loopback_tcp_bytes_per_s() for _ in range(3)]
    instrument_apply()
    side = asyncio.run(rollout_side(args, model_dir))
    pushes = side["pushes"]
    model_bytes = pushes[0]["model_bytes"]
    med = statistics.median
    push_s = med(p["seconds"] for p in pushes)
    apply_s = med(p["apply_seconds"] for p in pushes)
    transfer_s = med(p["seconds"] - p["apply_seconds"] for p in pushes)
    reload_s = med(side["reload_weights_seconds"])
    summary = {
        "model": args.model,
        "model_bytes": model_bytes,
        "transport": args.transport,
        "load_average_start_end": [load_start, os.getloadavg()],
        "bucket_mb": args.bucket_mb,
        "spool_dir": args.spool_dir or tempfile.gettempdir(),
        "pushes": len(pushes),
        "push_s": push_s,
        "transfer_s": transfer_s,
        "apply_s": apply_s,
        "push_bytes_per_s": model_bytes / push_s,
        "transfer_bytes_per_s": model_bytes / transfer_s,
        "loopback_tcp_bytes_per_s": med(tcp),
        "transfer_vs_loopback": (model_bytes / transfer_s) / med(tcp),
        "reload_weights_s": reload_s,
        "push_vs_reload_weights": push_s / reload_s,
        # an atomic push applies nothing before its last byte is checked: even a transfer at the full loopback
        # rate is followed by an apply of at least reload_weights' own time
        "atomic_push_floor_vs_reload_weights": (model_bytes / med(tcp) + reload_s) / reload_s,
        "learner_extra_rss_mb": med(p["extra_rss"] for p in pushes) / 2**20,
        "rollout_extra_rss_mb": med(p["rollout_extra_rss"] for p in pushes) / 2**20,
        "reload_weights_extra_rss_mb": med(side["reload_weights_extra_rss"]) / 2**20,
        "raw": {"pushes": pushes, "reload_weights_s": side["reload_weights_seconds"], "loopback_tcp": tcp},
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
