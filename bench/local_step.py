"""The local pipeline, one short `python -m services.launcher train` run per mode on one shared tiny model:
the median learner step, where the CPU went, where the rollout's time went (the agent loop's stages) and
how much generation overlapped the learner's update.

    nice python bench/local_step.py --steps 10 --modes budget,off --runs 1
    nice python bench/local_step.py --config configs/tiny_model_rl.yaml --modes s0,s1 \
        --mode-set s1=algorithm.max_staleness=1 --runs 3

Step time is the learner's `step_seconds` (collect + score + update + push + checkpoint), the median over
steps 2..N (step 1 includes warm-up). CPU is sampled every `--sample-s` from every service process and the
vLLM processes below them (psutil): CPU seconds spent from the end of step 1 to the end of the run, per
process. Modes: `budget` (the thread budget, the default) and `off` (the behaviour before it: no thread
environment, every pool sized to the machine); any other name is the default plus its `--mode-set
NAME=key=value` overrides. Extra `--set a.b=value` overrides go to every run; `--config` picks the recipe.

The rollout server's /metrics is scraped every `--scrape-s`: per step (between two of the launcher's step
lines) the seconds summed over episodes in each agent-loop stage (`omrl_rollout_loop_stage_seconds`), the
engine's idle seconds and the tokens generated. The timeline puts the generated-token counter against the
learner's phases (`started_at`, `collect_seconds`, `step_seconds` of its history): "overlap" is the share of
a step's tokens generated while the learner trained, pushed and checkpointed (0 when nothing overlaps).
JSON goes to `--out` (default bench/results/)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.result_path import result_path  # noqa: E402


def build_model(out_dir: Path, overrides: list[str], config: str | None) -> Path:
    from services.common.config import load_config
    from services.launcher.tiny import prepare_tiny_model

    return prepare_tiny_model(load_config(config, overrides), out_dir / "model", print)


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


STAGE = "omrl_rollout_loop_stage_seconds"
COUNTERS = ("omrl_rollout_generated_tokens_total", "omrl_rollout_engine_idle_seconds_total")


def scrape(url: str) -> dict[str, float] | None:
    """Stage sums and counts, generated tokens and engine idle seconds from a rollout /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (f"{STAGE}_sum", f"{STAGE}_count"):
                out[f"{sample.labels['stage']}{sample.name[len(STAGE) :]}"] = sample.value
            elif sample.name in COUNTERS or sample.name == "omrl_rollout_active_requests":
                out[sample.name] = sample.value
    return out


class MetricsScraper:
    """Scrapes the rollout server's /metrics (its port from the rollout log) every `every_s`, with times."""

    def __init__(self, log_file: Path, every_s: float):
        self.log_file, self.every_s = log_file, every_s
        self.url: str | None = None
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> MetricsScraper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _find_url(self) -> str | None:
        try:
            for line in self.log_file.read_text(errors="replace").splitlines():
                if line.startswith("rollout metrics on "):
                    return f"http://{line.split()[-1]}/metrics"
        except OSError:
            pass
        return None

    def sample(self) -> dict[str, float] | None:
        self.url = self.url or self._find_url()
        if self.url is None:
            return None
        values = scrape(self.url)
        if values is not None:
            self.samples.append((time.time(), values))
        return values

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def at(self, when: float, key: str) -> float:
        """`key` linearly interpolated at epoch time `when` (clamped to the samples' range)."""
        series = [(t, v[key]) for t, v in self.samples if key in v]
        if not series:
            return 0.0
        if when <= series[0][0]:
            return series[0][1]
        for (t0, v0), (t1, v1) in zip(series, series[1:]):
            if when <= t1:
                return v0 + (v1 - v0) * (when - t0) / max(t1 - t0, 1e-9)
        return series[-1][1]


def stage_rows(marks: list[dict[str, float]]) -> list[dict[str, float]]:
    """Per step (between consecutive marks): seconds per stage, calls per stage, tokens and engine idle."""
    rows = []
    for before, after in zip(marks, marks[1:]):
        row = {}
        for key, value in after.items():
            delta = value - before.get(key, 0.0)
            if key.endswith("_sum"):
                row[key[: -len("_sum")] + "_s"] = round(delta, 4)
            elif key.endswith("_count"):
                row[key[: -len("_count")] + "_calls"] = int(delta)
            elif key == "omrl_rollout_generated_tokens_total":
                row["generated_tokens"] = int(delta)
            elif key == "omrl_rollout_engine_idle_seconds_total":
                row["engine_idle_s"] = round(delta, 4)
        rows.append(row)
    return rows


def timeline(history: list[dict], scraper: MetricsScraper) -> list[dict]:
    """Per step: its phases in seconds from the run's first step start, and the share of the tokens generated
    in the step's window that were generated while the learner trained (after its collect phase)."""
    if not history or "started_at" not in history[0]:
        return []
    origin, out = history[0]["started_at"], []
    key = "omrl_rollout_generated_tokens_total"
    for m in history:
        start = m["started_at"]
        collected, end = start + m["collect_seconds"], start + m["step_seconds"]
        total = scraper.at(end, key) - scraper.at(start, key)
        during_update = scraper.at(end, key) - scraper.at(collected, key)
        out.append(
            {
                "step": m["step"],
                "start_s": round(start - origin, 3),
                "collected_s": round(collected - origin, 3),
                "end_s": round(end - origin, 3),
                "tokens": round(total),
                "tokens_while_training": round(during_update),
                "overlap": round(during_update / total, 3) if total > 0 else 0.0,
            }
        )
    return out


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
        f"threads.budget={'false' if mode == 'off' else 'true'}",
        *[item for o in [*args.set, *args.mode_sets.get(mode, [])] for item in ("--set", o)],
    ]
    if args.config:
        cmd[4:4] = ["--config", str(Path(args.config).resolve())]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY"):
        env.pop(name, None)  # `off` must see the library defaults
    sampler = CpuSampler(runs_dir / run / "pids.json", args.sample_s).start()
    scraper = MetricsScraper(runs_dir / run / "logs" / "rollout.log", args.scrape_s).start()
    marks: list[dict[str, float]] = []
    start = time.monotonic()
    lines: list[str] = []
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("step   1/"):
                sampler.mark("step1")
            if line.startswith("step ") and "/" in line.split()[1]:
                marks.append(scraper.sample() or (marks[-1] if marks else {}))
        code = proc.wait()
    sampler.stop()
    scraper.stop()
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

    for m in timed:  # waiting for its trajectories (rollout); older histories: what is left of the step
        m["collect_s"] = m.get("collect_seconds") or m["step_seconds"] - sum(
            m.get(k, 0.0) for k in ("time/score_s", "time/policy_update_s", "push_seconds", "checkpoint_seconds")
        )
    cpu = sampler.since("step1")
    stages = stage_rows(marks)  # stages[i]: from the end of step i+1 to the end of step i+2
    steps_timeline = timeline(history, scraper)
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
        "stages_per_step": stages,
        "stage_median_s": median_stages(stages),
        "timeline": steps_timeline,
        "token_samples": [(round(t, 3), v.get("omrl_rollout_generated_tokens_total")) for t, v in scraper.samples],
        "median_overlap": round(statistics.median(t["overlap"] for t in steps_timeline[1:]), 3)
        if len(steps_timeline) > 1
        else None,
        "time_to_success": time_to(history, args.success),
    }
    print(
        f"{mode} #{index}: median step {result['median_step_s']}s (score {result['median_score_s']}s, update "
        f"{result['median_update_s']}s, collect {result['median_collect_s']}s) | CPU after step 1: "
        f"{result['cpu_s_after_step1_total']}s total | " + ", ".join(f"{k} {v}" for k, v in list(cpu.items())[:6]),
        flush=True,
    )
    print_stages(stages, steps_timeline)
    print(
        f"  median overlap {result['median_overlap']} | success >= {args.success:.0%}: "
        f"{result['time_to_success'] or 'not reached'}",
        flush=True,
    )
    return result


def median_stages(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for row in rows for k in row if k.endswith("_s")})
    return {k: round(statistics.median(row.get(k, 0.0) for row in rows), 4) for k in keys}


SHOWN = (
    "generate",
    "weights_wait",
    "detokenize",
    "parse",
    "tokenize",
    "env_create",
    "env_step",
    "env_close",
    "reward",
    "reward_wait",
    "publish",
)


def print_stages(rows: list[dict[str, float]], steps_timeline: list[dict]) -> None:
    """One line per step: seconds summed over episodes per stage, engine idle, tokens, overlap."""
    print("  step | " + " ".join(f"{s[:9]:>9}" for s in (*SHOWN, "slot_wait", "eng_idle")) + " | tokens overlap")
    for i, row in enumerate(rows):
        step = i + 2
        over = next((t["overlap"] for t in steps_timeline if t["step"] == step), None)
        cells = [row.get(f"{s}_s", 0.0) for s in (*SHOWN, "slot_wait")] + [row.get("engine_idle_s", 0.0)]
        print(
            f"  {step:4d} | "
            + " ".join(f"{c:9.3f}" for c in cells)
            + f" | {row.get('generated_tokens', 0):6d} {over if over is not None else '-'}",
            flush=True,
        )


def time_to(history: list[dict], threshold: float) -> dict | None:
    """First step whose success rate reaches `threshold`, with the step seconds summed up to it."""
    total = 0.0
    for m in history:
        total += m["step_seconds"]
        if m.get("success_rate", 0.0) >= threshold:
            return {"step": m["step"], "step_seconds_sum": round(total, 1)}
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--runs", type=int, default=1, help="runs per mode, interleaved")
    parser.add_argument("--modes", default="budget,off")
    parser.add_argument("--sample-s", type=float, default=0.5)
    parser.add_argument("--scrape-s", type=float, default=0.25, help="rollout /metrics scrape interval")
    parser.add_argument("--config", help="recipe (e.g. configs/tiny_model_rl.yaml); default: the built-in config")
    parser.add_argument("--success", type=float, default=0.9, help="success rate for the time-to figure")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--mode-set", action="append", default=[], metavar="MODE=KEY=VALUE", help="an override for one mode"
    )
    parser.add_argument("--model", help="model directory (default: build the tiny model once)")
    parser.add_argument("--work-dir", default=str(ROOT / "runs" / "bench-local-step"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.mode_sets = {}
    for item in args.mode_set:
        mode, _, override = item.partition("=")
        args.mode_sets.setdefault(mode, []).append(override)
    runs_dir = Path(args.work_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else build_model(runs_dir, args.set, args.config)
    results = [run_once(mode, i, args, model, runs_dir) for i in range(args.runs) for mode in args.modes.split(",")]
    write_summary("local_step", args, results)
    return 0


def write_summary(name: str, args: argparse.Namespace, results: list[dict], **figures) -> None:
    """The runs' JSON (to `args.out`, default bench/results/NAME_<time>.json) with the machine and settings."""
    out = result_path(args.out, name)
    summary = {
        "cores": len(os.sched_getaffinity(0)),
        "load_avg_at_end": os.getloadavg(),
        "steps": args.steps,
        "config": args.config,
        "overrides": args.set,
        "mode_overrides": args.mode_sets,
        **figures,
        "runs": results,
    }
    out.write_text(json.dumps(summary, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
