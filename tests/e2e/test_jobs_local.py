"""The job API as a real process with the local launcher, every service a real process: one tiny job
submitted with the CLI runs to completion while the API is killed (SIGKILL) and restarted under it; a
second job waits in the queue, starts, and is cancelled with its processes stopped by PID; a third is
cancelled while queued. All tests share that one timeline."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from services.common.config import StreamConfig
from services.common.grpc_server import free_port
from tests.support.api_process import JobApiProcess
from tests.support.processes import alive

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TOKEN = "e2e-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def cli(api: JobApiProcess, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "--api", api.url, "--token", TOKEN, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wait_until(http: httpx.Client, job_id: str, done, timeout_s: float = 400, what: str = "") -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        job = http.get(f"/v1/jobs/{job_id}").json()
        if done(job):
            return job
        assert time.monotonic() < deadline, f"job {job_id} never {what}: {job['state']} {job.get('error')}"
        time.sleep(0.5)


def service_pids(job: dict) -> dict[str, int]:
    path = Path(job["launcher_info"]["run_dir"]) / "pids.json"
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.fixture(scope="module")
def timeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("jobs-e2e")
    spec = root / "job.yaml"
    spec.write_text(
        "run: e2e\nlearner: {steps: 2}\nmodel: {warmstart_steps: 5}\nrollout: {group_size: 4, groups_per_step: 2}\n"
    )
    port, out, apis = free_port(), {}, []
    api = JobApiProcess(root, port, TOKEN).start()
    apis.append(api)
    http = httpx.Client(base_url=api.url, headers=AUTH, timeout=30)
    try:
        submitted = cli(api, "submit", str(spec))
        assert submitted.returncode == 0, submitted.stderr
        job_id = out["job_id"] = submitted.stdout.strip()
        # kill the API while the job's services start (vLLM loading): the job must not notice
        job = wait_until(
            http,
            job_id,
            lambda j: j["state"] in ("starting", "running") and service_pids(j),
            what="started its services",
        )
        out["supervisor_pid"] = job["launcher_info"]["pid"]
        api.stop(signal.SIGKILL)
        out["supervisor_alive_without_api"] = alive(out["supervisor_pid"])
        api = JobApiProcess(root, port, TOKEN).start()
        apis.append(api)
        out["after_restart"] = http.get(f"/v1/jobs/{job_id}").json()
        model = Path(job["launcher_info"]["run_dir"]) / "model" / "warm"
        second = http.post(
            "/v1/jobs",
            json={
                "run": "to-cancel",
                "model": {"path": str(model)},
                "learner": {"steps": 1000},
                "rollout": {"group_size": 4},
            },
        ).json()
        third = http.post("/v1/jobs", json={"run": "never-started"}).json()
        out["second_id"] = second["id"]
        out["queued_states"] = (second["state"], third["state"])
        out["third"] = http.post(f"/v1/jobs/{third['id']}/cancel").json()
        followed = cli(api, "follow", job_id)
        out["follow"] = followed
        out["job"] = http.get(f"/v1/jobs/{job_id}").json()
        out["events"] = http.get(f"/v1/jobs/{job_id}/events").json()["events"]
        out["learner_log"] = http.get(f"/v1/jobs/{job_id}/logs", params={"service": "learner", "tail": 50}).text
        out["pids"] = {**service_pids(out["job"]), "supervisor": out["supervisor_pid"]}
        # the second job leaves the queue once the first is done; cancel it once its services exist
        running = wait_until(
            http,
            second["id"],
            lambda j: j["state"] in ("starting", "running") and service_pids(j),
            what="started its services",
        )
        out["second_pids"] = {**service_pids(running), "supervisor": running["launcher_info"]["pid"]}
        started = time.monotonic()
        cancelled = cli(api, "cancel", second["id"], "--wait")
        out["cancel"], out["cancel_seconds"] = cancelled, time.monotonic() - started
        out["second"] = http.get(f"/v1/jobs/{second['id']}").json()
        out["second_events"] = http.get(f"/v1/jobs/{second['id']}/events").json()["events"]
        out["listed"] = {j["id"]: j["state"] for j in http.get("/v1/jobs").json()["jobs"]}
        yield out
    finally:
        try:
            for job in http.get("/v1/jobs", params={"state": ["queued", "starting", "running"]}).json()["jobs"]:
                http.post(f"/v1/jobs/{job['id']}/cancel")
            for pid in [*out.get("pids", {}).values(), *out.get("second_pids", {}).values()]:
                if alive(pid):  # a failed test must not leave training processes behind
                    os.killpg(pid, signal.SIGKILL)
        finally:
            http.close()
            for running_api in apis:
                running_api.stop()
            forget_runs([out.get("job_id"), out.get("second_id")])


def forget_runs(job_ids) -> None:
    """Jobs' run state lives in Redis under omrl:<job id>:*; a test leaves none behind."""
    client = redis.Redis.from_url(StreamConfig().redis_url)
    try:
        for job_id in filter(None, job_ids):
            keys = list(client.scan_iter(f"omrl:{job_id}:*"))
            if keys:
                client.delete(*keys)
    finally:
        client.close()


def states(events):
    return [e["data"]["state"] for e in events if e["type"] == "state"]


def test_the_job_ran_to_completion_through_the_api(timeline):
    job = timeline["job"]
    assert job["state"] == "succeeded", job["error"]
    assert job["step"] == job["total_steps"] == 2 and job["policy_version"] == 2
    assert isinstance(job["metrics"]["reward_mean"], float) and job["finished_at"]
    assert states(timeline["events"]) == ["queued", "starting", "running", "succeeded"]
    assert [e["data"]["step"] for e in timeline["events"] if e["type"] == "step"] == [1, 2]
    assert "step 2:" in timeline["learner_log"]


def test_start_up_stages_reached_the_job_s_event_stream(timeline):
    stages = [
        (e["data"]["service"], e["data"]["stage"])
        for e in timeline["events"]
        if e["type"] == "message" and "stage" in e["data"]
    ]
    for expected in [
        ("model", "building"),
        ("model", "ready"),
        ("envs", "healthy"),
        ("reward", "healthy"),
        ("rollout", "healthy"),
        ("run", "healthy"),
    ]:
        assert expected in stages, stages
    assert stages.index(("model", "ready")) < stages.index(("rollout", "healthy")) < stages.index(("run", "healthy"))
    followed = timeline["follow"].stdout
    assert "  rollout: healthy after" in followed and "  all services healthy" in followed


def test_the_cli_followed_it_with_live_progress(timeline):
    followed = timeline["follow"]
    assert followed.returncode == 0, followed.stderr
    lines = followed.stdout.splitlines()
    assert any(line.startswith("step 1/2 [") for line in lines) and any(line.startswith("step 2/2 [") for line in lines)
    assert lines[-1] == f"job {timeline['job_id']} succeeded"


def test_the_job_outlived_an_api_kill_and_is_marked_as_taken_up_again(timeline):
    assert timeline["supervisor_alive_without_api"]
    after = timeline["after_restart"]
    assert after["id"] == timeline["job_id"] and after["state"] in ("starting", "running")
    assert after["recovered_at"] is not None
    notes = [e["data"]["message"] for e in timeline["events"] if e["type"] == "message"]
    assert any(n.startswith("job API restarted while this job was") for n in notes)
    assert f"re-attached to the job's supervisor (pid {timeline['supervisor_pid']})" in notes


def test_every_process_of_the_finished_job_has_exited(timeline):
    assert set(timeline["pids"]) == {"envs", "reward", "rollout", "learner", "supervisor"}
    assert not [name for name, pid in timeline["pids"].items() if alive(pid)]


def test_a_queued_job_is_cancelled_without_ever_starting(timeline):
    assert timeline["queued_states"] == ("queued", "queued")
    third = timeline["third"]
    assert third["state"] == "cancelled" and third["launcher_info"] == {} and third["started_at"] is None


def test_a_started_job_is_cancelled_and_its_processes_stopped_by_pid(timeline):
    cancelled = timeline["cancel"]
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert timeline["cancel_seconds"] < 90, "stopped cleanly, before the launcher's SIGKILL grace ran out"
    second = timeline["second"]
    assert second["state"] == "cancelled" and second["error"] is None
    assert states(timeline["second_events"])[-2:] == ["cancelling", "cancelled"]
    assert set(timeline["second_pids"]) == {"envs", "reward", "rollout", "learner", "supervisor"}
    assert not [name for name, pid in timeline["second_pids"].items() if alive(pid)]
    status = json.loads((Path(second["launcher_info"]["run_dir"]) / "status.json").read_text())
    assert status["state"] == "cancelled"


def test_the_list_shows_all_three(timeline):
    assert sorted(timeline["listed"].values()) == ["cancelled", "cancelled", "succeeded"]
