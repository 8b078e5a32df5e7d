"""Local pipeline with and without the thread budget (`threads.budget`): a short `python -m services.launcher
train` run per mode on one shared tiny model, the median learner step and where the CPU went.

    nice python bench/local_step.py --steps 10 --modes budget,off --runs 1

Step time is the learner's `step_seconds` (collect + score + update + push + checkpoint), the median over
steps 2..N (step 1 includes warm-up). CPU is sampled every `--sample-s` from every service process and the
vLLM processes below them (psutil): CPU seconds spent from the end of step 1 to the end of the run, per
process. `off` is the behaviour before the budget: no thread environment, every pool sized to the machine.
Extra `--set a.b=value` overrides go to every run. JSON goes to `--out` (default bench/results/)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_model(out_dir: Path, overrides: list[str]) -> Path:
    from services.common.config import load_config
    from services.launcher.tiny import prepare_tiny_model

    return prepare_tiny_model(load_config(None, overrides), out_dir / "model", print)


def label(service: str, proc: psutil.Process, root_pid: int) -> str:
    if proc.pid == root_pid:
        return service
    try:
        return f"{service}/{proc.name()}"
    except psutil.Error:
        return f"{service}/child"


class CpuSampler:
    """Cumulative CPU seconds of every service process and its descendants, last value seen per PID."""

    def __init__(self, pids_file: Path, every_s: float):
        self.pids_file, self.every_s = pids_file, every_s
        self.last: dict[int, tuple[str, float]] = {}
        self.marks: dict[str, dict[int, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> CpuSampler:
        self._thread.start()
        return self

    def mark(self, name: str) -> None:
        self.sample()
        self.marks[name] = {pid: cpu for pid, (_, cpu) in self.last.items()}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        try:
            services = json.loads(self.pids_file.read_text())
        except (OSError, ValueError):
            return
        for service, pid in services.items():
            try:
                root = psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for proc in procs:
                try:
                    times = proc.cpu_times()
                    self.last[proc.pid] = (label(service, proc, pid), times.user + times.system)
                except psutil.Error:
                    continue

    def since(self, mark: str) -> dict[str, float]:
        base = self.marks.get(mark, {})
        out: dict[str, float] = {}
        for pid, (name, cpu) in self.last.items():
            out[name] = round(out.get(name, 0.0) + cpu - base.get(pid, 0.0), 2)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def forget_run(run: str) -> None:
    """A bench run's state in Redis (kept by the launcher for resuming) is of no use afterwards."""
    import redis

    from services.common.config import StreamConfig

    stream = StreamConfig()
    client = redis.Redis.from_url(stream.redis_url, socket_timeout=10)
    try:
        keys = list(client.scan_iter(f"{stream.prefix}:{run}:*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def run_once(mode: str, index: int, args: argparse.Namespace, model: Path, runs_dir: Path) -> dict:
    run = f"bench-threads-{mode}-{index}-{os.getpid()}"
    cmd = [
        sys.executable,
        "-m",
        "services.launcher",
        "train",
        "--plain",
        "--set",
        f"run={run}",
        "--set",
        f"output_dir={runs_dir}",
        "--set",
        f"model.path={model}",
        "--set",
        f"learner.steps={args.steps}",
        "--set",
        f"threads.budget={'true' if mode == 'budget' else 'false'}",
        *[item for o in args.set for item in ("--set", o)],
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY"):
        env.pop(name, None)  # `off` must see the library defaults
    sampler = CpuSampler(runs_dir / run / "pids.json", args.sample_s).start()
    start = time.monotonic()
    lines: list[str] = []
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("step   1/"):
                sampler.mark("step1")
        code = proc.wait()
    sampler.stop()
    wall = time.monotonic() - start
    forget_run(run)
    history_file = runs_dir / run / "history.json"
    if code != 0 or not history_file.exists():
        raise RuntimeError(f"{mode} run {index} failed ({code}):\n" + "\n".join(lines[-30:]))
    history = json.loads(history_file.read_text())
    timed = history[1:] or history

    def median(key: str) -> float | None:
        values = [m[key] for m in timed if key in m]
        return round(statistics.median(values), 4) if values else None

    for m in timed:  # what is left of the step: waiting for its trajectories (rollout) and bookkeeping
        m["collect_s"] = m["step_seconds"] - sum(
            m.get(k, 0.0) for k in ("time/score_s", "time/policy_update_s", "push_seconds", "checkpoint_seconds")
        )
    cpu = sampler.since("step1")
    result = {
        "mode": mode,
        "run": run,
        "wall_s": round(wall, 1),
        "steps": len(history),
        "median_step_s": median("step_seconds"),
        "median_score_s": median("time/score_s"),
        "median_update_s": median("time/policy_update_s"),
        "median_push_s": median("push_seconds"),
        "median_checkpoint_s": median("checkpoint_seconds"),
        "median_collect_s": median("collect_s"),
        "step_seconds": [round(m["step_seconds"], 3) for m in history],
        "reward_mean": [round(m.get("reward_mean", float("nan")), 4) for m in history],
        "success_rate": [round(m.get("success_rate", float("nan")), 4) for m in history],
        "cpu_s_after_step1": cpu,
        "cpu_s_after_step1_total": round(sum(cpu.values()), 2),
    }
    print(
        f"{mode} #{index}: median step {result['median_step_s']}s (score {result['median_score_s']}s, update "
        f"{result['median_update_s']}s, collect {result['median_collect_s']}s) | CPU after step 1: "
        f"{result['cpu_s_after_step1_total']}s total | " + ", ".join(f"{k} {v}" for k, v in list(cpu.items())[:6]),
        flush=True,
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--runs", type=int, default=1, help="runs per mode, interleaved")
    parser.add_argument("--modes", default="budget,off")
    parser.add_argument("--sample-s", type=float, default=0.5)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--model", help="model directory (default: build the tiny model once)")
    parser.add_argument("--work-dir", default=str(ROOT / "runs" / "bench-local-step"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    runs_dir = Path(args.work_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else build_model(runs_dir, args.set)
    results = [run_once(mode, i, args, model, runs_dir) for i in range(args.runs) for mode in args.modes.split(",")]
    out = Path(args.out or ROOT / "bench" / "results" / f"local_step_{time.strftime('%Y%m%d_%H%M%S')}.json")
    summary = {
        "cores": len(os.sched_getaffinity(0)),
        "load_avg_at_end": os.getloadavg(),
        "steps": args.steps,
        "overrides": args.set,
        "runs": results,
    }
    out.write_text(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
