"""Runs one training job on this machine: every service its own process, against Redis."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from services.common.config import TrainConfig, dump_config
from services.common.grpc_server import free_port
from services.common.run_state import RunState
from services.launcher.processes import ServiceProcess, python_module
from services.launcher.report import learning_summary, step_line, write_reward_curve


@dataclass
class RunResult:
    history: list[dict]
    run_dir: Path
    curve: Path | None
    summary: dict


class LocalRun:
    def __init__(self, config: TrainConfig, say: Callable[[str], None] = print, health_timeout_s: float = 300.0):
        self.config, self.say, self.health_timeout_s = config, say, health_timeout_s
        self.run_dir = config.run_dir
        self.processes: list[ServiceProcess] = []

    def prepare_model(self) -> None:
        if self.config.model.path:
            return
        from services.launcher.tiny import prepare_tiny_model

        start = time.perf_counter()
        self.config.model.path = str(prepare_tiny_model(self.config, self.run_dir / "model", self.say))
        self.say(f"tiny model ready in {time.perf_counter() - start:.0f}s: {self.config.model.path}")

    def _assign_addresses(self) -> dict[str, int]:
        ports = {name: free_port() for name in ("envs", "reward", "rollout", "envs_m", "reward_m", "rollout_m",
                                                 "learner_m")}
        self.config.env.address = f"127.0.0.1:{ports['envs']}"
        self.config.reward.address = f"127.0.0.1:{ports['reward']}"
        self.config.rollout.addresses = [f"127.0.0.1:{ports['rollout']}"]
        self.config.learner.checkpoint_dir = str(self.run_dir / "checkpoints")
        return ports

    def start(self) -> None:
        self.prepare_model()
        ports = self._assign_addresses()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.run_dir / "config.yaml"
        config_path.write_text(dump_config(self.config))
        state = RunState.connect(self.config)
        state.reset()
        cfg, logs = ["--config", str(config_path)], self.run_dir / "logs"
        self.processes = [
            ServiceProcess("envs", python_module("services.envs", *cfg, "--port", str(ports["envs"]), "--metrics-port",
                                                 str(ports["envs_m"])), logs / "envs.log", self.config.env.address),
            ServiceProcess("reward", python_module("services.reward", *cfg, "--port", str(ports["reward"]),
                                                   "--metrics-port", str(ports["reward_m"])), logs / "reward.log",
                           self.config.reward.address),
            ServiceProcess("rollout", python_module("services.rollout", *cfg, "--port", str(ports["rollout"]),
                                                    "--metrics-port", str(ports["rollout_m"])), logs / "rollout.log",
                           self.config.rollout.addresses[0]),
        ]
        learner_args = [*cfg, "--metrics-port", str(ports["learner_m"]), "--history", str(self.run_dir / "history.json")]
        if self.config.learner.nproc > 1:
            launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.config.learner.nproc}",
                        "-m", "services.learner"]
            learner_cmd = [sys.executable, *launcher, *learner_args]
        else:
            learner_cmd = python_module("services.learner", *learner_args)
        self.processes.append(ServiceProcess("learner", learner_cmd, logs / "learner.log"))
        for proc in self.processes:
            proc.start()
        self.say(f"started {', '.join(f'{p.name} (pid {p.pid})' for p in self.processes)}; logs in {logs}")
        for proc in self.processes:
            proc.wait_healthy(self.health_timeout_s)
        self.say("all services healthy")

    def follow(self) -> list[dict]:
        state = RunState.connect(self.config)
        history, last_id, learner = [], "0", self.processes[-1]
        while True:
            for last_id, metrics in state.read_metrics(last_id, block_ms=1000):
                history.append(metrics)
                self.say(step_line(metrics, self.config.learner.steps))
            if not learner.running():
                for last_id, metrics in state.read_metrics(last_id):
                    history.append(metrics)
                    self.say(step_line(metrics, self.config.learner.steps))
                if learner.popen.returncode != 0:
                    raise RuntimeError(f"learner exited with {learner.popen.returncode}:\n{learner.log_tail()}")
                return history
            for proc in self.processes[:-1]:
                if not proc.running():
                    raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()

    def run(self) -> RunResult:
        try:
            self.start()
            history = self.follow()
        finally:
            self.stop()
        (self.run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in history))
        curve, summary = None, {}
        if history:
            curve = write_reward_curve(history, self.run_dir / "reward_curve.png",
                                       f"{self.config.env.name}: {self.config.algorithm.advantage}")
            summary = learning_summary(history)
            self.say(f"reward {summary['first_reward']:+.3f} -> {summary['last_reward']:+.3f}, success "
                     f"{100 * summary['first_success']:.0f}% -> {100 * summary['last_success']:.0f}% "
                     f"(mean of first/last {summary['window']} steps); curve: {curve}")
        return RunResult(history, self.run_dir, curve, summary)
