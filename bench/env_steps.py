"""One turn of N concurrent episodes against a real env service process: N single `Step` calls against one
`StepBatch` call (`env.batch_steps`), interleaved, on the same server; also the rollout-side CPU per wave.

    nice python bench/env_steps.py --episodes 64,128 --reps 5

A wave is what the agent loop does after an engine step whose replies came out together: every episode
asks for its env step at once. Printed: the median wave time (first call sent to last reply) and the
median of the client process's CPU time per wave, per mode. JSON goes to `--out` (default bench/results/)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.result_path import result_path  # noqa: E402


async def wave(address: str, episodes: int, batch: bool) -> tuple[float, float]:
    from services.envs.client import GrpcEnvClient

    async with GrpcEnvClient(address, timeout_s=60, batch_steps=batch) as client:
        states = await asyncio.gather(
            *(client.create("corridor", i, {"length": 64, "distance": 30}) for i in range(episodes))
        )
        cpu, start = time.process_time(), time.perf_counter()
        await asyncio.gather(*(client.step(s.episode_id, "left") for s in states))
        took, cpu = time.perf_counter() - start, time.process_time() - cpu
        await asyncio.gather(*(client.close(s.episode_id) for s in states))
    return took, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", default="64,128")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from services.common.grpc_server import free_port, wait_for_health

    port = free_port()
    address = f"127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    server = subprocess.Popen(
        [sys.executable, "-m", "services.envs", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    results = []
    try:
        asyncio.run(wait_for_health(address, 60))
        for n in (int(x) for x in args.episodes.split(",")):
            runs: dict[str, list[tuple[float, float]]] = {"single": [], "batch": []}
            for _ in range(args.reps):
                for mode in runs:
                    runs[mode].append(asyncio.run(wave(address, n, mode == "batch")))
            row = {"episodes": n}
            for mode, values in runs.items():
                row[f"{mode}_wave_ms"] = round(statistics.median(v[0] for v in values) * 1e3, 1)
                row[f"{mode}_client_cpu_ms"] = round(statistics.median(v[1] for v in values) * 1e3, 1)
                row[f"{mode}_all_wave_ms"] = [round(v[0] * 1e3, 1) for v in values]
            row["ratio"] = round(row["batch_wave_ms"] / row["single_wave_ms"], 3)
            results.append(row)
            print(
                f"{n} episodes: wave single {row['single_wave_ms']} ms vs batch {row['batch_wave_ms']} ms "
                f"(x{row['ratio']}); client CPU {row['single_client_cpu_ms']} vs {row['batch_client_cpu_ms']} ms "
                f"(medians of {args.reps}, interleaved)",
                flush=True,
            )
    finally:
        server.terminate()
        server.wait(timeout=30)
    out = result_path(args.out, "env_steps")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"load_avg_at_end": os.getloadavg(), "results": results}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
