"""The trajectory inspector through FastAPI's TestClient: run folders and the job API's jobs as data sources, every
page against the stored records (charts, a step's episodes and its filters, an episode's transcript and tokens),
model text escaped, live runs refreshing, and the job API's mount refusing requests without its token."""

import json
import re
import subprocess
import sys
from datetime import datetime, timezone

import pytest
from fastapi.testclient import TestClient
from markupsafe import escape

from services.jobs.app import create_app
from services.jobs.inspector.app import create_inspector
from services.jobs.inspector.gate import COOKIE
from services.jobs.inspector.sources.folders import FolderSource
from services.jobs.models import JobRecord
from services.jobs.settings import JobsSettings
from services.jobs.spec import JobSpec
from services.learner.episodes import episode_summary
from tests.support.fake_launcher import FakeLauncher
from tests.support.inspector_runs import HOSTILE_TEXT, finished_run, live_run, metrics

TOKEN = "inspector-token-1"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    recorded = finished_run(root / "alpha")
    finished_run(root / "beta", offset=0.5)
    live_run(root / "gamma")
    (root / "not-a-run").mkdir()
    return root, recorded


@pytest.fixture(scope="module")
def client(root):
    return TestClient(create_inspector(FolderSource(root[0])))


def chart_points(page: str, title: str) -> dict[str, list[tuple[int, float]]]:
    """{run: [(step, value)]} of one chart on a page."""
    block = page.split(f'data-title="{title}"', 1)[1].split('<div class="chart"', 1)[0]
    out = {}
    for run, body in re.findall(r'<g class="series" data-run="([^"]*)"[^>]*>(.*?)</g>', block, re.S):
        out[run] = [(int(s), float(v)) for s, v in re.findall(r'data-step="(\d+)" data-value="([^"]+)"', body)]
    return out


def episode_ids(page: str) -> list[str]:
    return re.findall(r'<tr class="episode" data-trajectory="([^"]+)"', page)


# -- data sources -----------------------------------------------------------------------------------
def test_a_root_folder_lists_its_runs_with_status_and_last_step(root):
    folder, _ = root
    runs = {run.name: run for run in FolderSource(folder).runs()}
    assert set(runs) == {"alpha", "beta", "gamma"}
    assert (runs["alpha"].status, runs["alpha"].last_step, runs["alpha"].total_steps) == ("succeeded", 3, 3)
    assert (runs["gamma"].status, runs["gamma"].last_step) == ("unknown", 2)


def test_a_single_run_folder_is_one_run_and_the_live_trackers_last_entry_of_a_step_wins(root):
    folder, _ = root
    source = FolderSource(folder / "gamma")
    assert [run.name for run in source.runs()] == ["gamma"]
    steps = source.metrics("gamma")
    assert [m["step"] for m in steps] == [1, 2] and steps[-1]["reward_mean"] == 9.5


def test_a_run_whose_processes_live_is_running_and_a_supervisors_outcome_is_its_status(tmp_path):
    finished_run(tmp_path / "live", steps=1)
    (tmp_path / "live" / "metrics.jsonl").unlink()
    # named relative to its working directory, as the services of a run with a relative output_dir name it
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "live/config.yaml"], cwd=tmp_path)
    try:
        (tmp_path / "live" / "pids.json").write_text(json.dumps({"learner": proc.pid}))
        finished_run(tmp_path / "broken", steps=1)
        status = {"pid": 1, "phase": "exited", "state": "failed", "error": "learner exited with 1"}
        (tmp_path / "broken" / "status.json").write_text(json.dumps(status))
        runs = {run.name: run for run in FolderSource(tmp_path).runs()}
        assert runs["live"].status == "running"
        assert (runs["broken"].status, runs["broken"].detail) == ("failed", "learner exited with 1")
    finally:
        proc.kill()
        proc.wait()
    assert FolderSource(tmp_path).run("live").status == "unknown"  # a dead PID is not a running run


# -- pages ------------------------------------------------------------------------------------------
def test_the_run_list_shows_each_run_with_a_compare_checkbox_and_refreshes_while_one_runs(client):
    page = client.get("/").text
    for name, status in (("alpha", "succeeded"), ("beta", "succeeded"), ("gamma", "unknown")):
        row = page.split(f'<tr data-run="{name}">', 1)[1].split("</tr>", 1)[0]
        assert f'value="{name}"' in row and f"status-{status}" in row
    assert "not-a-run" not in page and 'http-equiv="refresh"' not in page


def test_a_runs_curves_hold_its_metrics(client):
    page = client.get("/runs/alpha").text
    want = metrics(3)
    for title, key in (("reward", "reward_mean"), ("KL", "approx_kl"), ("step time (s)", "step_seconds")):
        assert chart_points(page, title) == {"alpha": [(m["step"], m[key]) for m in want]}
    assert f'data-key="reward_mean">{want[-1]["reward_mean"]:.6g}</td>' in page
    assert [int(s) for s in re.findall(r'/runs/alpha/steps/(\d+)"', page)] == [1, 2, 3]


def test_the_comparison_draws_every_picked_run_on_one_chart(client):
    page = client.get("/compare", params=[("run", "alpha"), ("run", "beta")]).text
    points = chart_points(page, "reward")
    assert points == {
        "alpha": [(m["step"], m["reward_mean"]) for m in metrics(3)],
        "beta": [(m["step"], m["reward_mean"]) for m in metrics(3, 0.5)],
    }
    assert client.get("/compare", params={"run": "nope"}).status_code == 404


def test_a_steps_page_lists_its_episodes_by_group_with_their_values(client, root):
    rows = root[1][2]
    page = client.get("/runs/alpha/steps/2").text
    assert episode_ids(page) == [r["trajectory_id"] for r in rows]
    assert page.count('<tr class="group">') == len({r["group_id"] for r in rows})
    summary = episode_summary(rows[1])
    row_html = page.split(f'data-trajectory="{rows[1]["trajectory_id"]}"', 1)[1].split("</tr>", 1)[0]
    assert f'data-key="reward">{summary["reward"]:.4f}<' in row_html
    assert f'data-key="advantage_mean">{summary["advantage_mean"]:+.4f}<' in row_html


@pytest.mark.parametrize(
    "query, keep",
    [
        ({"success": "false"}, lambda r: not r["success"]),
        ({"errors": "true"}, lambda r: r["invalid_actions"] > 0),
        ({"env": "corridor"}, lambda r: r["env"] == "corridor"),
        ({"stop_reason": "max_turns", "env": "maze"}, lambda r: r["stop_reason"] == "max_turns" and r["env"] == "maze"),
    ],
)
def test_filters_keep_exactly_the_matching_episodes(client, root, query, keep):
    rows = root[1][3]
    page = client.get("/runs/alpha/steps/3", params=query).text
    want = [r["trajectory_id"] for r in rows if keep(r)]
    assert want and episode_ids(page) == want
    assert f"{len(want)} of {len(rows)} recorded episodes" in page


@pytest.mark.parametrize("sort", ["reward", "advantage_mean"])
def test_sorting_by_reward_or_mean_advantage(client, root, sort):
    rows = root[1][1]
    summaries = sorted((episode_summary(r) for r in rows), key=lambda s: s[sort], reverse=True)
    page = client.get("/runs/alpha/steps/1", params={"sort": sort}).text
    assert episode_ids(page) == [s["trajectory_id"] for s in summaries]
    ascending = client.get("/runs/alpha/steps/1", params={"sort": sort, "ascending": "true"}).text
    assert episode_ids(ascending) == [s["trajectory_id"] for s in reversed(summaries)]


def test_an_episode_shows_its_turns_reward_breakdown_and_escapes_model_text(client, root):
    row = root[1][2][0]
    page = client.get(f"/runs/alpha/steps/2/episodes/{row['trajectory_id']}").text
    assert HOSTILE_TEXT not in page and "<script>" not in page and str(escape(HOSTILE_TEXT)) in page
    assert page.count('<div class="turn invalid"') == row["invalid_actions"] == len(row["turns"])
    for turn in row["turns"]:
        assert str(escape(turn["observation"])) in page
    assert f'data-component="goal">{row["reward"]:.6g}<' in page and 'data-component="format">0.25<' in page


@pytest.mark.parametrize("mode", ["loss_mask", "advantage", "logprob_diff"])
def test_the_token_view_shows_every_token_with_its_recorded_values(client, root, mode):
    row = root[1][1][4]
    page = client.get(f"/runs/alpha/steps/1/episodes/{row['trajectory_id']}", params={"mode": mode}).text
    view = page.split('id="tokens"', 1)[1]
    assert f'data-mode="{mode}"' in page.split('id="tokens"', 1)[0] + 'id="tokens"' + view[:40]
    spans = re.findall(r'<span([^>]*)title="([^"]*)">([^<]*)</span>', view)
    assert [text for _, _, text in spans] == row["token_text"]
    t = row["turns"][0]["start"]  # the first model token
    attrs, title, _ = spans[t]
    assert f"advantage {row['advantages'][t]:+.4f}" in title and f"learner {row['learner_logprobs'][t]:.4f}" in title
    assert f"loss_mask {row['loss_mask'][t]}" in title and 'class="model"' in attrs
    coloured = sum("background" in attrs for attrs, _, _ in spans)
    if mode == "loss_mask":
        assert coloured == sum(t["model_tokens"] for t in row["turns"])
    assert client.get(f"/runs/alpha/steps/1/episodes/{row['trajectory_id']}", params={"mode": "x"}).status_code == 422


def test_missing_runs_steps_and_episodes_are_404(client):
    assert client.get("/runs/nope").status_code == 404
    assert "step 9 has no recorded episodes" in client.get("/runs/alpha/steps/9").text
    assert client.get("/runs/alpha/steps/1/episodes/nope").status_code == 404


def test_a_live_run_refreshes_itself(tmp_path):
    finished_run(tmp_path / "run", steps=1)
    (tmp_path / "run" / "metrics.jsonl").unlink()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(tmp_path / "run")])
    try:
        (tmp_path / "run" / "pids.json").write_text(json.dumps({"learner": proc.pid}))
        client = TestClient(create_inspector(FolderSource(tmp_path)))
        for path in ("/", "/runs/run", "/runs/run/steps/1"):
            assert '<meta http-equiv="refresh" content="5">' in client.get(path).text
    finally:
        proc.kill()
        proc.wait()


# -- mounted in the job API -------------------------------------------------------------------------
@pytest.fixture
def api(tmp_path, root):
    settings = JobsSettings(token=TOKEN, db=tmp_path / "jobs.sqlite", output_dir=tmp_path / "out")
    app = create_app(settings, launcher=FakeLauncher())
    with TestClient(app) as client:
        stamp = datetime.now(timezone.utc)
        record = JobRecord(
            id="job-one",
            name="one",
            state="succeeded",
            launcher="local",
            created_at=stamp,
            updated_at=stamp,
            step=3,
            total_steps=3,
            launcher_info={"run_dir": str(root[0] / "alpha")},
            spec=JobSpec(run="one"),
        )
        app.state.store.insert(record)
        app.state.store.add_events("job-one", [("step", m) for m in metrics(3, 0.25)])
        yield client


def test_the_api_mount_refuses_requests_without_its_token(api):
    for path in ("/inspect/", "/inspect/runs/job-one", "/inspect/compare?run=job-one"):
        assert api.get(path).status_code == 401
        assert api.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        api.cookies.set(COOKIE, "wrong")
        assert api.get(path).status_code == 401
        api.cookies.clear()
        assert api.get(path, params={"token": "wrong"}).status_code == 401


def test_the_api_mount_shows_jobs_with_their_step_events_and_local_episodes(api, root):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert 'data-run="job-one"' in api.get("/inspect/", headers=auth).text
    page = api.get("/inspect/runs/job-one", headers=auth).text
    assert chart_points(page, "reward") == {"job-one": [(m["step"], m["reward_mean"]) for m in metrics(3, 0.25)]}
    assert 'href="/inspect/runs/job-one/steps/2"' in page
    episodes = api.get("/inspect/runs/job-one/steps/2", headers=auth).text
    assert episode_ids(episodes) == [r["trajectory_id"] for r in root[1][2]]


def test_a_browser_logs_in_once_with_the_token_and_keeps_a_strict_httponly_cookie(api):
    response = api.get("/inspect/runs/job-one", params={"token": TOKEN, "mode": "x"}, follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == "/inspect/runs/job-one?mode=x"
    cookie = response.headers["set-cookie"]
    assert TOKEN not in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/inspect" in cookie
    assert api.get("/inspect/runs/job-one").status_code == 200  # the client kept the cookie


# -- omrl inspect -----------------------------------------------------------------------------------
def test_omrl_inspect_prints_a_jobs_page_in_the_api_and_refuses_what_is_neither_folder_nor_job(capsys):
    from services.cli.main import main as omrl

    assert omrl(["--api", "https://api.example/", "inspect", "my-job"]) == 0
    assert capsys.readouterr().out.strip() == "https://api.example/inspect/runs/my-job"
    assert omrl(["inspect", "no/such/folder"]) == 2
    assert "not a folder, nor a job id" in capsys.readouterr().err


# -- omrl episodes JOB: the API's /v1/jobs/{id}/episodes --------------------------------------------
def test_omrl_episodes_reads_a_jobs_records_through_the_api(api, root, capsys):
    from services.cli.client import JobsClient
    from services.cli.main import build_parser, run

    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert api.get("/v1/jobs/job-one/episodes").status_code == 401
    page = api.get("/v1/jobs/job-one/episodes", headers=auth).json()
    assert page["step"] == page["steps"][-1] and page["episodes"] == json.loads(json.dumps(root[1][page["step"]]))
    assert api.get("/v1/jobs/job-one/episodes", params={"step": 99}, headers=auth).status_code == 404
    assert api.get("/v1/jobs/no-such-job/episodes", headers=auth).status_code == 404

    client = JobsClient("http://testserver", TOKEN)
    client.http = api
    api.headers.update(auth)
    parser, flags = build_parser()
    args = parser.parse_args(["episodes", "job-one", "--step", "2", "--sort", "reward", "--limit", "2"])
    assert run(args, flags, client) == 0
    out = capsys.readouterr().out
    best = sorted(root[1][2], key=lambda r: r["reward"], reverse=True)[:2]
    assert out.startswith(f"step 2: 2 of {len(root[1][2])} recorded episodes")
    assert all(row["trajectory_id"] in out for row in best)


def test_a_job_whose_run_folder_is_elsewhere_says_so(api):
    store = api.app.state.store
    store.save(store.get("job-one").model_copy(update={"launcher_info": {"run_dir": "/nowhere/on/this/machine"}}))
    response = api.get("/v1/jobs/job-one/episodes", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 409 and "not on the API's machine" in response.json()["detail"]


def test_an_unknown_query_parameter_of_the_episodes_route_is_refused(api):
    response = api.get("/v1/jobs/job-one/episodes", params={"stepp": 2}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["query", "stepp"]
