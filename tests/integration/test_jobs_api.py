"""The job API over real HTTP (uvicorn on a free port) with a scripted launcher and real Redis for progress:
auth, validation errors naming the field, body limit, the job resource, events (page and SSE), metrics,
records across an app restart, and the `omrl` CLI against it."""

import json
import sqlite3
import threading
import time
from datetime import datetime, timezone

import httpx
import pytest
from fastapi.routing import APIRoute

from services.cli.main import main as omrl
from services.common.config import load_config
from services.common.run_state import RunState
from services.jobs.app import create_app
from services.jobs.models import JobRecord
from services.jobs.settings import JobsSettings
from services.jobs.spec import JobSpec
from tests.support.fake_launcher import FakeLauncher
from tests.support.live_api import LiveApi

TOKEN = "test-token-123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SCRIPTS = {"quick": ("running", "running", "succeeded"), "forever": ("running",)}


def make_app(tmp_path, launcher=None, **settings):
    settings = JobsSettings(
        token=TOKEN,
        db=tmp_path / "jobs.sqlite",
        poll_interval_s=0.05,
        max_body_bytes=64 * 1024,
        allowed_data_roots=[tmp_path / "data"],
        output_dir=tmp_path / "out",
        **settings,
    )
    return create_app(settings, launcher=launcher or FakeLauncher(scripts=SCRIPTS))


@pytest.fixture(scope="module")
def api(tmp_path_factory, redis_url):
    root = tmp_path_factory.mktemp("api")
    with (
        LiveApi(make_app(root, redis_url=redis_url)) as live,
        httpx.Client(base_url=live.url, headers=AUTH, timeout=10) as http,
    ):
        live.http, live.root = http, root
        yield live


def wait_for(http, job_id, states, timeout_s=10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        job = http.get(f"/v1/jobs/{job_id}").json()
        if job["state"] in states:
            return job
        assert time.monotonic() < deadline, f"job {job_id} stuck in {job['state']}"
        time.sleep(0.05)


def submit(http, **spec) -> dict:
    response = http.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    return response.json()


# -- auth ------------------------------------------------------------------------------------------
def test_health_needs_no_token(api):
    for path in ("/healthz", "/readyz"):
        assert httpx.get(api.url + path).status_code == 200


def protected_routes(app):
    for route in app.routes:
        if isinstance(route, APIRoute) and route.path not in ("/healthz", "/readyz"):
            for method in route.methods:
                yield method, route.path.replace("{job_id}", "some-job")


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}],
    ids=["none", "wrong-token", "wrong-scheme"],
)
def test_every_other_route_answers_401_without_the_right_token(api, headers):
    routes = list(protected_routes(api.app))
    assert {path for _, path in routes} >= {
        "/v1/jobs",
        "/v1/jobs/some-job",
        "/v1/jobs/some-job/cancel",
        "/v1/jobs/some-job/events",
        "/v1/jobs/some-job/logs",
        "/metrics",
    }
    for method, path in routes:
        response = httpx.request(method, api.url + path, headers=headers, json={})
        assert response.status_code == 401, (method, path)
        assert response.headers["www-authenticate"] == "Bearer"


def test_the_openapi_document_is_served_and_declares_bearer_auth(api):
    doc = httpx.get(api.url + "/openapi.json").json()
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel", "/v1/jobs/{job_id}/events"} <= set(
        doc["paths"]
    )
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert "JobSpec" in doc["components"]["schemas"] and "ResourcesConfig" in doc["components"]["schemas"]


def test_the_openapi_document_can_be_put_behind_the_token(tmp_path):
    with LiveApi(make_app(tmp_path, public_docs=False)) as live:
        assert httpx.get(live.url + "/openapi.json").status_code == 401
        assert httpx.get(live.url + "/openapi.json", headers=AUTH).json()["info"]["title"] == "OpenManus-RL job API"
        assert httpx.get(live.url + "/docs").status_code == 404


# -- validation --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec,loc,kind",
    [
        ({"learner": {"stepz": 3}}, ["body", "learner", "stepz"], "extra_forbidden"),
        ({"colour": "blue"}, ["body", "colour"], "extra_forbidden"),
        ({"rollout": {"temperature": 9}}, ["body", "rollout", "temperature"], "less_than_equal"),
        ({"resources": {"learner": {"gpus": 99}}}, ["body", "resources", "learner", "gpus"], "less_than_equal"),
        ({"schedule": {"max_runtime_s": 1}}, ["body", "schedule", "max_runtime_s"], "greater_than_equal"),
        ({"env": {"name": "babyai"}}, ["body", "env", "name"], "launcher_rejected"),
        ({"algorithm": {"advantage": "grpoo"}}, ["body", "algorithm", "advantage"], "value_error"),
        ({"env": {"name": "corridorr"}}, ["body", "env", "name"], "value_error"),
        ({"env": {"options": {"lenght": 5}}}, ["body", "env", "options", "lenght"], "unknown_option"),
        ({"env": {"options": {"length": "many"}}}, ["body", "env", "options", "length"], "invalid_option"),
        ({"rollout": {"action_parser": "xml"}}, ["body", "rollout", "action_parser"], "value_error"),
        (
            {"reward": {"components": {"goal": {"params": {"wieght": 2}}}}},
            ["body", "reward", "components", "goal", "params", "wieght"],
            "unknown_param",
        ),
        ({"reward": {"components": {"goall": {}}}}, ["body", "reward", "components", "goall", "[key]"], "value_error"),
    ],
)
def test_a_bad_spec_is_a_422_naming_the_field(api, spec, loc, kind):
    launcher = api.app.state.manager.launcher
    jobs_before, started_before = api.http.get("/v1/jobs").json()["total"], list(launcher.started)
    response = api.http.post("/v1/jobs", json=spec)
    assert response.status_code == 422
    assert {"loc": loc, "type": kind}.items() <= response.json()["detail"][0].items()
    assert api.http.get("/v1/jobs").json()["total"] == jobs_before, "a rejected spec is never stored"
    assert launcher.started == started_before, "nor launched"


def test_a_misspelt_plugin_is_a_422_listing_the_choices(api):
    response = api.http.post("/v1/jobs", json={"algorithm": {"advantage": "grpoo"}})
    assert response.status_code == 422
    assert "'grpoo' is not one of: gae, gigpo, grpo, opo, reinforce_plus_plus" in response.json()["detail"][0]["msg"]


@pytest.mark.parametrize(
    "body,loc",
    [
        ('{"algorithm": {"kl_coef": Infinity}}', ["body", "algorithm", "kl_coef"]),
        ('{"rollout": {"temperature": NaN}}', ["body", "rollout", "temperature"]),
        ('{"learner": {"push_timeout_s": -Infinity}}', ["body", "learner", "push_timeout_s"]),
        ('{"env": {"options": {"length": Infinity}}}', ["body", "env", "options"]),
    ],
)
def test_non_finite_numbers_are_a_422_naming_the_field(api, body, loc):
    response = api.http.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == loc


@pytest.mark.parametrize(
    "spec,loc",
    [
        ({"algorithm": {"kl_coef": 1e300}}, ["body", "algorithm", "kl_coef"]),
        ({"learner": {"steps": 10**12}}, ["body", "learner", "steps"]),
        ({"seed": -1}, ["body", "seed"]),
    ],
)
def test_out_of_bounds_numbers_are_a_422_naming_the_field(api, spec, loc):
    response = api.http.post("/v1/jobs", json=spec)
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == loc


def path_escapes(root):
    (root / "data").mkdir(exist_ok=True)
    link = root / "data" / "link"
    if not link.exists():
        link.symlink_to(root.parent)
    return [
        ({"env": {"data_dir": str(root / "data" / ".." / "elsewhere")}}, ["body", "env", "data_dir"]),
        ({"env": {"dataset": str(link / "corridor")}}, ["body", "env", "dataset"]),
        ({"model": {"path": "/etc"}}, ["body", "model", "path"]),
        ({"model": {"path": "../model"}}, ["body", "model", "path"]),
        ({"output_dir": "/tmp"}, ["body", "output_dir"]),
        ({"learner": {"checkpoint_dir": "runs/../../x"}}, ["body", "learner", "checkpoint_dir"]),
        ({"stream": {"redis_url": "redis://attacker:6379/0"}}, ["body", "stream", "redis_url"]),
    ]


def test_paths_outside_the_allowed_roots_and_a_callers_redis_are_refused(api):
    for spec, loc in path_escapes(api.root):
        response = api.http.post("/v1/jobs", json=spec)
        assert response.status_code == 422, (spec, response.text)
        detail = response.json()["detail"][0]
        assert detail["loc"] == loc and detail["type"] == "not_allowed", spec


def test_paths_inside_the_allowed_roots_and_hub_ids_are_accepted(api):
    inside = {
        "env": {"data_dir": str(api.root / "data" / "sets"), "dataset": str(api.root / "out" / "d")},
        "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"},
        "run": "quick",
    }
    job = submit(api.http, **inside)
    assert job["spec"]["env"]["data_dir"] == inside["env"]["data_dir"]
    wait_for(api.http, job["id"], {"succeeded"})


def test_an_unreadable_stored_record_fails_alone_and_the_api_keeps_answering(api):
    broken = {"id": insert_unreadable(api.root / "jobs.sqlite", "broken-0000abcd", "queued")}
    fine = submit(api.http, run="quick")
    wait_for(api.http, fine["id"], {"succeeded"})
    failed = wait_for(api.http, broken["id"], {"failed"})
    assert "unreadable" in failed["error"] and "algorithm.kl_coef" in failed["error"]
    assert api.http.get("/v1/jobs").status_code == 200
    assert httpx.get(api.url + "/readyz").status_code == 200


def test_reading_an_unreadable_finished_record_repairs_it_at_once(api):
    job_id = insert_unreadable(api.root / "jobs.sqlite", "done-0000abcd", "succeeded")
    assert job_id in {j["id"] for j in api.http.get("/v1/jobs", params={"limit": 500}).json()["jobs"]}
    job = api.http.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "succeeded" and "algorithm.kl_coef" in job["error"]
    kept = [
        e["data"] for e in api.http.get(f"/v1/jobs/{job_id}/events").json()["events"] if "stored_record" in e["data"]
    ]
    assert len(kept) == 1


def insert_unreadable(db_path, job_id: str, state: str) -> str:
    """A new row, so that no reconcile pass holds a good copy of it to save over the damage."""
    stamp = datetime.now(timezone.utc)
    record = JobRecord(
        id=job_id,
        name="broken",
        state=state,
        launcher="fake",
        created_at=stamp,
        updated_at=stamp,
        total_steps=1,
        spec=JobSpec(),
    )
    doc = json.loads(record.model_dump_json())
    doc["spec"]["algorithm"]["kl_coef"] = None  # what an earlier version stored for Infinity
    with sqlite3.connect(db_path) as db:
        db.execute(
            "INSERT INTO jobs (id, state, created_at, doc) VALUES (?, ?, ?, ?)",
            (job_id, state, stamp.timestamp(), json.dumps(doc)),
        )
    return job_id


class FlakyLauncher(FakeLauncher):
    """Every reconcile pass fails while `down` is set (capacity is asked once per pass)."""

    def __init__(self):
        super().__init__()
        self.down = threading.Event()

    def capacity(self):
        if self.down.is_set():
            raise ConnectionError("launcher backend unreachable")
        return None


def test_readiness_fails_while_no_reconcile_pass_completes(tmp_path):
    launcher = FlakyLauncher()
    with LiveApi(make_app(tmp_path, launcher=launcher, reconcile_max_age_s=0.3)) as live:
        deadline = time.monotonic() + 20

        def readyz():
            return httpx.get(live.url + "/readyz")

        while readyz().status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        launcher.down.set()
        # (a loaded machine may stall a pass past the age limit on its own: wait for the failing one's reason)
        while not ((answer := readyz()).status_code == 503 and "launcher backend unreachable" in answer.text):
            assert time.monotonic() < deadline, answer.text
            time.sleep(0.02)
        launcher.down.clear()
        while readyz().status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)


def test_an_unknown_query_parameter_is_a_422_naming_it(api):
    response = api.http.get("/v1/jobs", params={"stat": "running"})
    assert response.status_code == 422
    assert {"loc": ["query", "stat"], "type": "extra_forbidden"}.items() <= response.json()["detail"][0].items()


def test_a_cross_field_error_names_both_fields(api):
    response = api.http.post("/v1/jobs", json={"resources": {"learner": {"gpus": 2}}})
    assert response.status_code == 422
    assert "resources.learner.gpus (2) must equal learner.nproc (1)" in response.json()["detail"][0]["msg"]


def test_a_body_over_the_limit_is_a_413_announced_or_streamed(api):
    big = json.dumps({"env": {"options": {"blob": "x" * 70_000}}}).encode()
    assert api.http.post("/v1/jobs", content=big, headers={"content-type": "application/json"}).status_code == 413
    streamed = api.http.post(
        "/v1/jobs", content=iter([big[:40_000], big[40_000:]]), headers={"content-type": "application/json"}
    )
    assert streamed.status_code == 413 and "larger than 65536 bytes" in streamed.json()["detail"]


# -- the job resource ----------------------------------------------------------------------------------
def test_submit_read_list_and_cancel(api):
    job = submit(api.http, run="forever", learner={"steps": 5})
    assert job["state"] == "queued" and job["total_steps"] == 5 and job["spec"]["learner"]["steps"] == 5
    running = wait_for(api.http, job["id"], {"running"})
    assert running["launcher"] == "fake" and running["launcher_info"]["fake_id"] == job["id"]
    page = api.http.get("/v1/jobs", params={"state": ["running", "starting"], "limit": 500}).json()
    assert job["id"] in [j["id"] for j in page["jobs"]] and all(
        j["state"] in ("running", "starting") for j in page["jobs"]
    )
    cancel = api.http.post(f"/v1/jobs/{job['id']}/cancel")
    assert cancel.status_code == 202 and cancel.json()["state"] == "cancelling"
    assert wait_for(api.http, job["id"], {"cancelled"})["finished_at"]
    again = api.http.post(f"/v1/jobs/{job['id']}/cancel")
    assert again.status_code == 409 and "already cancelled" in again.json()["detail"]
    assert api.http.get("/v1/jobs/no-such-job-1").status_code == 404
    assert api.http.post("/v1/jobs/no-such-job-1/cancel").status_code == 404
    assert api.http.get("/v1/jobs/Not_A_Valid_Id").status_code == 422
    assert (
        api.http.get(f"/v1/jobs/{job['id']}/logs", params={"service": "rollout"}).text == f"rollout log of {job['id']}"
    )


def test_a_failing_launcher_backend_is_a_502_and_the_job_stays_as_it_was(api):
    job = submit(api.http, run="forever")
    wait_for(api.http, job["id"], {"running"})
    launcher = api.app.state.manager.launcher
    launcher.unreachable.add(job["id"])
    try:
        response = api.http.post(f"/v1/jobs/{job['id']}/cancel")
        assert response.status_code == 502 and "launcher backend unreachable" in response.json()["detail"]
        assert api.http.get(f"/v1/jobs/{job['id']}").json()["state"] == "running"
    finally:
        launcher.unreachable.discard(job["id"])
    assert api.http.post(f"/v1/jobs/{job['id']}/cancel").status_code == 202


def test_events_as_a_page_and_as_a_server_sent_stream(api):
    job = submit(api.http, run="quick")
    with api.http.stream("GET", f"/v1/jobs/{job['id']}/events", params={"follow": "true"}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        messages, current = [], {}
        for line in response.iter_lines():
            if line:
                field, _, value = line.partition(": ")
                current[field] = value
            elif current:
                messages.append(current)
                current = {}
    assert messages[-1]["event"] == "end" and json.loads(messages[-1]["data"]) == {"job_state": "succeeded"}
    events = [json.loads(m["data"]) for m in messages[:-1]]
    assert [e["data"]["state"] for e in events if e["type"] == "state"] == [
        "queued",
        "starting",
        "running",
        "succeeded",
    ]
    assert [int(m["id"]) for m in messages[:-1]] == [e["seq"] for e in events] == list(range(1, len(events) + 1))
    page = api.http.get(f"/v1/jobs/{job['id']}/events", params={"after": 2}).json()
    assert [e["seq"] for e in page["events"]] == list(range(3, len(events) + 1))
    assert page["finished"] and page["job_state"] == "succeeded" and page["next_after"] == len(events)
    with api.http.stream(
        "GET", f"/v1/jobs/{job['id']}/events", params={"follow": "true"}, headers={"Last-Event-ID": str(len(events))}
    ) as resumed:
        assert [line for line in resumed.iter_lines() if line.startswith("event:")] == ["event: end"]


def test_step_metrics_from_the_runs_redis_become_events_and_job_fields(api, redis_url):
    job = submit(api.http, run="forever")
    assert job["spec"]["stream"]["redis_url"] == redis_url  # the server's, set on every spec
    wait_for(api.http, job["id"], {"running"})
    state = RunState.connect(load_config(None, [f"run={job['id']}", f"stream.redis_url={redis_url}"]))
    try:
        for step in (1, 2):
            state.publish_metrics(
                step,
                {
                    "step": step,
                    "reward_mean": 0.1 * step,
                    "policy_version": step,
                    "approx_kl": float("nan"),
                    "pushes": [{"ok": True}],
                },
            )
        state.publish_version(2)
        deadline = time.monotonic() + 10
        while (current := api.http.get(f"/v1/jobs/{job['id']}").json())["step"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert current["policy_version"] == 2 and current["metrics"]["reward_mean"] == pytest.approx(0.2)
        assert current["metrics"]["approx_kl"] is None and "pushes" not in current["metrics"]
        steps = [
            e["data"]["step"]
            for e in api.http.get(f"/v1/jobs/{job['id']}/events").json()["events"]
            if e["type"] == "step"
        ]
        assert steps == [1, 2]
    finally:
        api.http.post(f"/v1/jobs/{job['id']}/cancel")
        state.reset()


def test_metrics_show_jobs_by_state_and_request_latency_by_route(api):
    job = submit(api.http, run="quick")
    wait_for(api.http, job["id"], {"succeeded"})
    text = api.http.get("/metrics").text
    succeeded = [line for line in text.splitlines() if line.startswith('omrl_api_jobs{state="succeeded"}')]
    assert succeeded and float(succeeded[0].split()[-1]) >= 1
    assert 'omrl_api_jobs{state="interrupted"} 0.0' in text
    assert 'omrl_api_request_seconds_count{method="POST",route="/v1/jobs",status="201"}' in text
    assert 'route="/v1/jobs/{job_id}"' in text and "some-job" not in text


def test_records_survive_an_app_restart(tmp_path):
    with LiveApi(make_app(tmp_path)) as first:
        job = submit(httpx.Client(base_url=first.url, headers=AUTH), run="forever")
    with LiveApi(make_app(tmp_path)) as second:
        got = httpx.get(f"{second.url}/v1/jobs/{job['id']}", headers=AUTH).json()
        assert got["id"] == job["id"] and got["created_at"] == job["created_at"]
        assert got["recovered_at"] is not None  # it was unfinished when the first app stopped


# -- the CLI ---------------------------------------------------------------------------------------
def test_cli_submit_follow_list_status_and_errors(api, tmp_path, capsys):
    spec = tmp_path / "job.yaml"
    spec.write_text("run: quick\nlearner:\n  steps: 3\n")
    base = ["--api", api.url, "--token", TOKEN]
    assert omrl([*base, "submit", str(spec), "--follow"]) == 0
    out = capsys.readouterr().out.splitlines()
    job_id = out[0]
    assert "state: running" in out and out[-1] == f"job {job_id} succeeded"
    assert omrl([*base, "list", "--state", "succeeded"]) == 0
    assert any(line.startswith(job_id) and "succeeded" in line for line in capsys.readouterr().out.splitlines())
    assert omrl([*base, "status", job_id]) == 0
    assert "state     succeeded" in capsys.readouterr().out
    assert omrl([*base, "cancel", job_id]) == 1
    assert "HTTP 409" in capsys.readouterr().err
    assert omrl([*base, "submit", str(spec), "--set", "rollout.temperature=9"]) == 2
    assert "rollout.temperature" in capsys.readouterr().err
    assert omrl(["--api", api.url, "--token", "wrong", "list"]) == 1
    assert "HTTP 401" in capsys.readouterr().err


def test_cli_cancel_waits_until_the_job_is_gone(api, capsys):
    job = submit(api.http, run="forever")
    wait_for(api.http, job["id"], {"running"})
    assert omrl(["--api", api.url, "--token", TOKEN, "cancel", job["id"], "--wait"]) == 0
    assert api.http.get(f"/v1/jobs/{job['id']}").json()["state"] == "cancelled"


def test_a_dumped_run_config_repeating_every_default_is_accepted(api, redis_url):
    spec = json.loads(JobSpec(run="quick").model_dump_json())  # output_dir, checkpoint_dir, redis_url: defaults
    job = submit(api.http, **spec)
    assert job["spec"]["stream"]["redis_url"] == redis_url  # still the server's
    wait_for(api.http, job["id"], {"succeeded"})
