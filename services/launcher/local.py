"""Runs one training job on this machine: every service its own process, against Redis."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import redis

from services.common.config import TrainConfig, dump_config
from services.common.cpu_budget import available_cores, engine_env, split, thread_env
from services.common.grpc_server import free_port
from services.common.run_state import RunState
from services.jobs.launchers import (
    CANCELLED,
    CANCELLING,
    FAILED,
    INTERRUPTED,
    LAUNCHERS,
    RUNNING,
    STARTING,
    Launcher,
    LaunchStatus,
    SpecRejected,
)
from services.jobs.spec import JobSpec
from services.launcher.job_files import EXITED, PIDS, PREPARING, STATUS, read_json
from services.launcher.job_files import STARTING as STARTING_PHASE
from services.launcher.processes import ServiceProcess, kill_group, python_module
from services.launcher.report import (
    ALERT_MARK,
    DETAIL_MARK,
    PlainView,
    alert_line,
    decode_stage,
    learning_summary,
    stage_record,
    validation_line,
    write_reward_curve,
)
from services.launcher.restarts import MAX_RESTARTS, RESTART_DELAY_S, exit_reason
from services.weightsync.credential import TOKEN_ENV


@dataclass
class RunResult:
    history: list[dict]
    run_dir: Path
    curve: Path | None
    summary: dict


class LocalRun:
    def __init__(
        self,
        config: TrainConfig,
        say: Callable[[str], None] = print,
        health_timeout_s: float = 300.0,
        restart_delay_s: float | None = None,
        view: Any = None,
        max_restarts: int = MAX_RESTARTS,
    ):
        """`restart_delay_s`: restart a service that exits after this long (the learner: one that fails), up to
        `max_restarts` times each, as Kubernetes restarts a pod; the restarted learner resumes from its last
        checkpoint. None (or no restarts left) ends the run instead, naming the service and its exit codes; a
        lost env replica excepted while another runs. `view` shows start-up stages, restarts and steps
        (`services.launcher.report.PlainView` through `say` by default)."""
        self.config, self.say, self.health_timeout_s = config, say, health_timeout_s
        self.view = view if view is not None else PlainView(say)
        self.restart_delay_s, self.max_restarts = restart_delay_s, max_restarts
        self._restart_at: dict[str, float] = {}
        self.restarts: dict[str, int] = {}
        self._state: RunState | None = None
        self._failure: dict[str, str] | None = None
        self.exit_codes: dict[str, list[int]] = {}
        """Exit codes of each service that exited while the run went on, in order."""
        self._exited: set[tuple[str, int]] = set()
        self.run_dir = config.run_dir
        self.processes: list[ServiceProcess] = []
        self.metrics_ports: dict[str, int] = {}
        """Prometheus /metrics port of each service on 127.0.0.1, known once started."""
        self.validations: list[dict] = []
        """Validation results (`kind: validation` entries of the metrics stream), in order."""
        self.lost_replicas: list[ServiceProcess] = []

    def prepare_model(self) -> None:
        if self.config.model.path:
            return
        from services.launcher.tiny import prepare_tiny_model

        start = time.perf_counter()
        self.stage(
            "model",
            "building",
            "model: building the tiny model (tokenizer, random init"
            + (
                f", {self.config.model.warmstart_steps} warm-start steps)" if self.config.model.warmstart_steps else ")"
            ),
        )
        self.config.model.path = str(prepare_tiny_model(self.config, self.run_dir / "model", self.say))
        took = time.perf_counter() - start
        self.stage(
            "model",
            "ready",
            f"model: tiny model ready in {took:.0f}s: {self.config.model.path}",
            elapsed_s=round(took, 1),
        )

    def stage(self, service: str, stage: str, message: str, **extra: Any) -> None:
        self.view.stage(stage_record(service, stage, message, **extra))

    def _assign_addresses(self) -> dict[str, int]:
        ports = {
            name: free_port() for name in ("envs", "reward", "rollout", "envs_m", "reward_m", "rollout_m", "learner_m")
        }
        for i in range(1, self.config.env.replicas):
            ports[f"envs-{i}"], ports[f"envs-{i}_m"] = free_port(), free_port()
        self.config.env.address = f"127.0.0.1:{ports['envs']}"
        if self.config.env.replicas > 1:  # one address for all replicas: gRPC spreads calls round-robin
            self.config.env.address = "ipv4:" + ",".join(f"127.0.0.1:{ports[n]}" for n in self._env_names())
        self.config.reward.address = f"127.0.0.1:{ports['reward']}"
        self.config.rollout.addresses = [f"127.0.0.1:{ports['rollout']}"]
        self.config.learner.checkpoint_dir = str(self.run_dir / "checkpoints")
        return ports

    def _env_names(self) -> list[str]:
        return ["envs"] + [f"envs-{i}" for i in range(1, self.config.env.replicas)]

    def _env_processes(self, ports: dict[str, int], cfg: list[str], logs: Path) -> list[ServiceProcess]:
        """One env-service process per replica; several find each other through Redis."""
        procs = []
        for name in self._env_names():
            direct = f"127.0.0.1:{ports[name]}"
            args = [*cfg, "--port", str(ports[name]), "--metrics-port", str(ports[f"{name}_m"]), "--skip-server-check"]
            if self.config.env.replicas > 1:
                args += ["--replica-id", name, "--advertise", direct, "--registry", "redis"]
            procs.append(ServiceProcess(name, python_module("services.envs", *args), logs / f"{name}.log", direct))
        return procs

    def start(self) -> None:
        from services.common.model_context import check_local_model
        from services.envs.datasets import ensure
        from services.envs.registry import preflight

        # first, in seconds: a context longer than the model's (the command line has said so already; a job's
        # supervisor has not), env servers that are down or of another kind, a dataset the env cannot serve
        check_local_model(self.config.model)
        checked = preflight(self.config.env)
        if checked:
            self.say(checked)
        self.say(f"task dataset: {ensure(self.config.env)}")
        self.prepare_model()
        ports = self._assign_addresses()
        self.metrics_ports = {name: ports[f"{name}_m"] for name in ("envs", "reward", "rollout", "learner")}
        self.metrics_ports.update({name: ports[f"{name}_m"] for name in self._env_names()})
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.run_dir / "config.yaml"
        config_path.write_text(dump_config(self.config))
        state = RunState.connect(self.config)
        state.reset()
        self.processes = self.service_processes(ports, config_path)
        for proc in self.processes:
            proc.start()
        self._write_pids()
        self.say(
            f"started {', '.join(f'{p.name} (pid {p.pid})' for p in self.processes)}; logs in {self.run_dir / 'logs'}"
        )
        for proc in self.processes:
            if proc.health_address:
                self._wait_healthy(proc)
        self.stage("run", "healthy", "all services healthy; the learner waits for the first step's episodes")

    def service_processes(self, ports: dict[str, int], config_path: Path) -> list[ServiceProcess]:
        """The run's processes, not started yet, the learner last; each with its share of the cores."""
        cfg, logs = ["--config", str(config_path)], self.run_dir / "logs"
        push_env = {TOKEN_ENV: secrets.token_urlsafe(32)}  # only this run's learner may push to its rollout
        processes = [
            *self._env_processes(ports, cfg, logs),
            ServiceProcess(
                "reward",
                python_module(
                    "services.reward", *cfg, "--port", str(ports["reward"]), "--metrics-port", str(ports["reward_m"])
                ),
                logs / "reward.log",
                self.config.reward.address,
            ),
            ServiceProcess(
                "rollout",
                python_module(
                    "services.rollout", *cfg, "--port", str(ports["rollout"]), "--metrics-port", str(ports["rollout_m"])
                ),
                logs / "rollout.log",
                self.config.rollout.addresses[0],
                env=push_env,
            ),
        ]
        learner_args = [
            *cfg,
            "--metrics-port",
            str(ports["learner_m"]),
            "--history",
            str(self.run_dir / "history.json"),
        ]
        if self.config.learner.nproc > 1:
            launcher = [
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={self.config.learner.nproc}",
                "-m",
                "services.learner",
            ]
            learner_cmd = [sys.executable, *launcher, *learner_args]
        else:
            learner_cmd = python_module("services.learner", *learner_args)
        processes.append(ServiceProcess("learner", learner_cmd, logs / "learner.log", env=push_env))
        thread_envs = self.thread_envs()
        for proc in processes:
            role = "envs" if proc.name in self._env_names() else proc.name
            proc.env = {**thread_envs.get(role, {}), **proc.env}
        return processes

    def thread_envs(self) -> dict[str, dict[str, str]]:
        """Thread-pool environment of each service role (`services.common.cpu_budget`); none without a budget."""
        threads = self.config.threads
        if not threads.budget:
            return {}
        budget = split(
            available_cores(),
            self.config.learner.nproc,
            threads.learner,
            threads.engine,
            threads.service,
            overlap=self.config.algorithm.max_staleness > 0,
        )
        small = thread_env(budget.service)
        return {"learner": thread_env(budget.learner), "rollout": engine_env(budget), "reward": small, "envs": small}

    def _wait_healthy(self, proc: ServiceProcess, first_s: float = 5.0, every_s: float = 15.0) -> None:
        """Says what a service does while it is not serving yet: after `first_s`, then every `every_s`."""
        what = "loading the vLLM engine" if proc.name == "rollout" else "starting"
        due = [first_s]

        def waiting(elapsed: float) -> None:
            if elapsed + 0.5 >= due[0]:  # the health check ticks about every 5 s
                due[0] = elapsed + every_s
                self.stage(proc.name, "loading", f"{proc.name}: {what} ({elapsed:.0f}s)", elapsed_s=round(elapsed, 1))

        took = proc.wait_healthy(self.health_timeout_s, on_wait=waiting)
        self.stage(proc.name, "healthy", f"{proc.name}: healthy after {took:.0f}s", elapsed_s=round(took, 1))

    def _record(self, metrics: dict, history: list[dict]) -> None:
        if metrics.get("kind") == "validation":  # the rollout's validation runs share the metrics stream
            self.validations.append(metrics)
            self.say(validation_line(metrics))
            return
        if metrics.get("kind") == "alert":  # e.g. a task quarantined: which task, which server, why
            self.say(alert_line(metrics))
            return
        history.append(metrics)
        self.view.step(metrics, self.config.learner.steps)

    def follow(self) -> list[dict]:
        state = self._state = RunState.connect(self.config)
        history, last_id, learner = [], "0", self.processes[-1]
        self.validations = []
        while True:
            for last_id, metrics in state.read_metrics(last_id, block_ms=1000):
                self._record(metrics, history)
            if not learner.running() and (learner.popen.returncode == 0 or not self._may_restart(learner)):
                for last_id, metrics in state.read_metrics(last_id):
                    self._record(metrics, history)
                if learner.popen.returncode != 0:
                    raise self._exit_error(learner)
                self._await_final_validation(state, last_id, history[-1]["step"] if history else 0)
                self._say_infra_counters(state)
                return history
            self._check_services()

    def _may_restart(self, proc: ServiceProcess) -> bool:
        if self.restart_delay_s is None or self.restarts.get(proc.name, 0) >= self.max_restarts:
            return False
        return proc is not self.processes[-1] or self._run_failure() is None

    def _run_failure(self) -> dict[str, str] | None:
        """Why the learner marked the run failed (`RunState.mark_failed`): restarted on the same config it would
        fail the same way, so it is not restarted."""
        if self._failure is None and self._state is not None:
            try:
                self._failure = self._state.failure()
            except redis.RedisError:  # Redis away too: restart as for any failure (the learner checks again)
                return None
        return self._failure

    def _check_services(self) -> None:
        """A service that exits is started again after `restart_delay_s`, up to `max_restarts` times. Past
        that, or with restarts off, a lost env replica is survivable while another runs (the rollout retries
        its episodes there), as a lost pod is under Kubernetes; any other lost service ends the run."""
        now = time.monotonic()
        for proc in self.processes:
            if proc.running() or proc in self.lost_replicas:
                continue
            if proc is self.processes[-1] and proc.popen.returncode == 0:
                continue  # the learner has finished: follow() ends the run
            self._note_exit(proc)
            if self._may_restart(proc):
                self._restart_when_due(proc, now)
                continue
            if proc is self.processes[-1]:
                continue  # follow() fails the run with the learner's exit
            env_replicas = [p for p in self.processes if p.name in self._env_names()]
            if proc in env_replicas and any(p.running() for p in env_replicas):
                self.lost_replicas.append(proc)
                live = sum(p.running() for p in env_replicas)
                self.say(f"{proc.name} exited with {proc.popen.returncode}; going on with {live} env replica(s)")
                continue
            raise self._exit_error(proc)

    def _restart_when_due(self, proc: ServiceProcess, now: float) -> None:
        """Says why the service stopped and when it comes back (a stage event: the live view and the job's
        events show it); starts it once the delay has passed."""
        n, code = self.restarts.get(proc.name, 0) + 1, proc.popen.returncode
        due = self._restart_at.get(proc.name)
        if due is None:
            self._restart_at[proc.name] = now + self.restart_delay_s
            self.stage(
                proc.name,
                "restarting",
                f"{proc.name} exited ({exit_reason(code)}); restarting it in {self.restart_delay_s:.0f}s "
                f"(restart {n} of {self.max_restarts})",
                exit_code=code,
                restart=n,
                max_restarts=self.max_restarts,
            )
        elif now >= due:
            del self._restart_at[proc.name]
            self.restarts[proc.name] = n
            proc.start()
            self._write_pids()
            self.stage(
                proc.name,
                "restarted",
                f"{proc.name} restarted (pid {proc.pid}, restart {n} of {self.max_restarts})",
                restart=n,
                max_restarts=self.max_restarts,
            )

    def _note_exit(self, proc: ServiceProcess) -> None:
        if (proc.name, proc.pid) not in self._exited:
            self._exited.add((proc.name, proc.pid))
            self.exit_codes.setdefault(proc.name, []).append(proc.popen.returncode)

    def _exit_error(self, proc: ServiceProcess) -> RuntimeError:
        """The run's failure: the service, its exit codes (all of them, when it was restarted) and its log's tail."""
        self._note_exit(proc)
        codes, restarts = self.exit_codes[proc.name], self.restarts.get(proc.name, 0)
        failure = self._run_failure() if proc is self.processes[-1] else None
        if failure is not None:
            return RuntimeError(
                f"{proc.name} exited with {codes[-1]}, not restarted (on the same config it would fail the same way): "
                f"{failure.get('reason')}\n{proc.log_tail()}"
            )
        if not restarts:
            return RuntimeError(f"{proc.name} exited with {codes[-1]}:\n{proc.log_tail()}")
        return RuntimeError(
            f"{proc.name} exited with {codes[-1]} after {restarts} restart(s) (exit codes "
            f"{', '.join(map(str, codes))}; at most {self.max_restarts} restarts):\n{proc.log_tail()}"
        )

    def _write_pids(self) -> None:
        # whoever outlives this process (the job API) can still stop the services by PID
        (self.run_dir / "pids.json").write_text(json.dumps({p.name: p.pid for p in self.processes}))

    def _await_final_validation(self, state: RunState, last_id: str, steps: int, timeout_s: float = 120.0) -> None:
        """The rollout validates the final policy (`steps`: the last step, early with `learner.stop_at_success`)
        after the learner has finished: wait for it."""
        every = self.config.env.validation_every
        if not every or steps % every or any(v["policy_version"] == steps for v in self.validations):
            return
        deadline = time.monotonic() + timeout_s
        rollout = next(p for p in self.processes if p.name == "rollout")
        while time.monotonic() < deadline and rollout.running():
            for last_id, metrics in state.read_metrics(last_id, block_ms=1000):
                if metrics.get("kind") == "validation":
                    self.validations.append(metrics)
                    self.say(validation_line(metrics))
                    if metrics["policy_version"] == steps:
                        return

    def _say_infra_counters(self, state: RunState) -> None:
        counters = state.rollout_counters()
        lost = {k: v for k, v in counters.items() if k != "groups_published" and v}
        if lost:
            self.say(
                "infrastructure failures (never scored): " + ", ".join(f"{k} {v}" for k, v in sorted(lost.items()))
            )

    def stop(self) -> None:
        if any(proc.running() for proc in self.processes):
            self.stage("run", "stopping", "stopping the services")
        for proc in reversed(self.processes):
            proc.stop()

    def run(self) -> RunResult:
        try:
            self.start()
            history = self.follow()
        finally:
            self.stop()
        (self.run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in history))
        if self.validations:
            (self.run_dir / "validation.jsonl").write_text("".join(json.dumps(m) + "\n" for m in self.validations))
        curve, summary = None, {}
        if history:
            curve = write_reward_curve(
                history, self.run_dir / "reward_curve.png", f"{self.config.env.name}: {self.config.algorithm.advantage}"
            )
            summary = learning_summary(history)
            self.say(
                f"reward {summary['first_reward']:+.3f} -> {summary['last_reward']:+.3f}, success "
                f"{100 * summary['first_success']:.0f}% -> {100 * summary['last_success']:.0f}% "
                f"(mean of first/last {summary['window']} steps); curve: {curve}"
            )
        return RunResult(history, self.run_dir, curve, summary)


@LAUNCHERS.register("local")
class LocalLauncher(Launcher):
    """The job API's launcher for this machine: each job runs under its own supervisor process
    (`services.launcher.supervisor`, which runs LocalRun). Jobs outlive the API: a restarted API
    re-attaches to a live supervisor by PID, and stops the leftovers of a dead one."""

    name = "local"
    # not repeated as messages: steps (the API reads them from the metrics stream) and progress bars
    _NOISE = re.compile(r"^step\s+\d+/\d+ \||\d+%\||^" + re.escape(DETAIL_MARK) + "|^" + re.escape(ALERT_MARK))

    def __init__(
        self,
        output_dir: str | Path = "runs/jobs",
        max_jobs: int = 1,
        cancel_grace_s: float = 90.0,
        max_restarts: int = MAX_RESTARTS,
        restart_delay_s: float = RESTART_DELAY_S,
    ):
        self.output_dir = Path(output_dir).resolve()
        self.max_jobs, self.cancel_grace_s = max_jobs, cancel_grace_s
        self.max_restarts, self.restart_delay_s = max_restarts, restart_delay_s
        self._children: dict[str, ServiceProcess] = {}

    def check(self, spec: JobSpec) -> None:
        for name in ("learner", "rollout", "reward"):  # env-service replicas run locally too (env.replicas)
            if getattr(spec.resources, name).replicas > 1:
                raise SpecRejected(
                    ("resources", name, "replicas"), "the local launcher runs one process of each service"
                )

    def capacity(self) -> int | None:
        return self.max_jobs

    def run_config(self, job_id: str, spec: JobSpec) -> TrainConfig:
        config = spec.train_config()
        config.run, config.output_dir = job_id, str(self.output_dir)
        if config.learner.weight_push == "nccl":  # the learner's rendezvous store is on this host
            config.learner.weight_nccl_host = "127.0.0.1"
        return config

    def start(self, job_id: str, spec: JobSpec) -> dict[str, Any]:
        config = self.run_config(job_id, spec)
        run_dir, job_file = config.run_dir, config.run_dir / "job.yaml"
        earlier = read_json(run_dir / STATUS).get("pid")
        if earlier and _alive(earlier, lambda p: str(job_file) in p.cmdline()):
            # the API died between starting this job and recording it: adopt that supervisor
            return {
                "run_dir": str(run_dir),
                "pid": earlier,
                "create_time": psutil.Process(earlier).create_time(),
                "log_offset": 0,
            }
        run_dir.mkdir(parents=True, exist_ok=True)
        job_file.write_text(dump_config(config))
        args = python_module(
            "services.launcher.supervisor",
            "--config",
            str(job_file),
            "--status",
            str(run_dir / STATUS),
            "--max-restarts",
            str(self.max_restarts),
            "--restart-delay-s",
            str(self.restart_delay_s),
        )
        if spec.schedule.max_runtime_s:
            args += ["--max-runtime-s", str(spec.schedule.max_runtime_s)]
        proc = ServiceProcess("supervisor", args, run_dir / "logs" / "supervisor.log").start()
        self._children[job_id] = proc
        try:
            create_time = psutil.Process(proc.pid).create_time()
        except psutil.NoSuchProcess:  # died at once; poll reports why from its log
            create_time = 0.0
        return {"run_dir": str(run_dir), "pid": proc.pid, "create_time": create_time, "log_offset": 0}

    def poll(self, job_id: str, handle: dict[str, Any]) -> LaunchStatus:
        handle = dict(handle)
        run_dir, messages = Path(handle["run_dir"]), self._new_log_lines(handle)
        cancel_at = handle.get("cancel_requested_at")
        if self._supervisor_alive(job_id, handle):
            if cancel_at and time.time() - cancel_at > self.cancel_grace_s:
                self._kill(handle)
                messages.append(f"still running {self.cancel_grace_s:.0f}s after the cancel: killed")
            if cancel_at:
                return LaunchStatus(CANCELLING, messages=messages, handle=handle)
            phase = read_json(run_dir / STATUS).get("phase")
            return LaunchStatus(
                STARTING if phase in (None, PREPARING, STARTING_PHASE) else RUNNING, messages=messages, handle=handle
            )
        child = self._children.pop(job_id, None)
        stopped = self._stop_leftovers(run_dir)
        if stopped:
            messages.append(f"stopped leftover service processes: {', '.join(stopped)}")
        status = read_json(run_dir / STATUS)
        if status.get("phase") == EXITED:
            return LaunchStatus(status["state"], error=status.get("error"), messages=messages, handle=handle)
        if cancel_at:
            return LaunchStatus(CANCELLED, messages=messages, handle=handle)
        code = child.popen.returncode if child else "unknown"
        return LaunchStatus(
            FAILED,
            error=f"supervisor (pid {handle['pid']}) exited with {code} before reporting an "
            f"outcome:\n{self.logs(job_id, handle, 'supervisor', 20)}",
            messages=messages,
            handle=handle,
        )

    def recover(self, job_id: str, handle: dict[str, Any]) -> LaunchStatus:
        if self._supervisor_alive(job_id, handle):
            status = self.poll(job_id, handle)
            status.messages.insert(0, f"re-attached to the job's supervisor (pid {handle['pid']})")
            return status
        if read_json(Path(handle["run_dir"]) / STATUS).get("phase") == EXITED or handle.get("cancel_requested_at"):
            return self.poll(job_id, handle)  # it ended on its own while the API was down
        stopped = self._stop_leftovers(Path(handle["run_dir"]))
        return LaunchStatus(
            INTERRUPTED,
            error=(
                f"the job's supervisor (pid {handle['pid']}) ended while the job API was down, without an outcome; "
                f"stopped its service processes ({', '.join(stopped) or 'none left'}); checkpoints stay in "
                f"{handle['run_dir']}/checkpoints"
            ),
            handle=handle,
        )

    def cancel(self, job_id: str, handle: dict[str, Any]) -> dict[str, Any]:
        handle = {**handle, "cancel_requested_at": time.time()}
        if self._supervisor_alive(job_id, handle):
            os.kill(handle["pid"], signal.SIGTERM)  # the supervisor stops its services, then exits
        return handle

    def logs(self, job_id: str, handle: dict[str, Any], service: str, tail: int) -> str:
        path = Path(handle["run_dir"]) / "logs" / f"{service}.log"
        try:
            with open(path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 256 * tail))
                return "\n".join(f.read().decode(errors="replace").splitlines()[-tail:])
        except FileNotFoundError:
            return ""

    # -- processes, found again by PID ------------------------------------------------------------
    def _supervisor_alive(self, job_id: str, handle: dict[str, Any]) -> bool:
        if job_id in self._children:
            return self._children[job_id].running()
        return _alive(handle["pid"], lambda p: abs(p.create_time() - handle["create_time"]) < 0.01)

    def _stop_leftovers(self, run_dir: Path) -> list[str]:
        """SIGKILLs service processes of the run that outlived their supervisor (their own process groups)."""
        config_arg, stopped = str(run_dir / "config.yaml"), []
        for name, pid in read_json(run_dir / PIDS).items():
            if _alive(pid, lambda p: config_arg in p.cmdline()):
                _kill_group(pid)
                stopped.append(f"{name} (pid {pid})")
        return stopped

    def _kill(self, handle: dict[str, Any]) -> None:
        if _alive(handle["pid"], lambda p: abs(p.create_time() - handle["create_time"]) < 0.01):
            _kill_group(handle["pid"])
        self._stop_leftovers(Path(handle["run_dir"]))

    def _new_log_lines(self, handle: dict[str, Any], limit: int = 200) -> list[str | dict[str, Any]]:
        """New lines of the supervisor's log as messages; `@stage` lines become structured start-up events."""
        path = Path(handle["run_dir"]) / "logs" / "supervisor.log"
        try:
            with open(path, "rb") as f:
                f.seek(handle.get("log_offset", 0))
                chunk = f.read(1 << 20)
        except FileNotFoundError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        handle["log_offset"] = handle.get("log_offset", 0) + len(complete)
        lines = [
            decode_stage(line) or line[:500]
            for line in complete.decode(errors="replace").splitlines()
            if line.strip() and not self._NOISE.search(line)
        ]
        return lines[-limit:]


def _alive(pid: int, same_process: Callable[[psutil.Process], bool]) -> bool:
    """True if `pid` runs and is still the process we started (PIDs get reused)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and same_process(proc)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _kill_group(pid: int) -> None:
    kill_group(pid)  # started in its own session: the group is the service and its workers
    deadline = time.monotonic() + 10
    while _alive(pid, lambda p: True) and time.monotonic() < deadline:
        time.sleep(0.1)
