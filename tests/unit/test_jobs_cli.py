"""The CLI's pieces that need no server: SSE following, error and progress rendering, argument handling."""

import json

import httpx
import pytest

from services.cli import render
from services.cli.client import ApiError, JobsClient, format_detail
from services.cli.main import main


def sse_client(body: str, status: int = 200) -> JobsClient:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.params["follow"] == "true"
        if status >= 400:
            return httpx.Response(status, json={"detail": "no job x"})
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    return JobsClient("http://api", "t", transport=httpx.MockTransport(handler))


def test_followed_events_skip_pings_and_end_with_the_job_state():
    first = {"seq": 1, "type": "state", "data": {"state": "running"}}
    second = {"seq": 2, "type": "message", "data": {"message": "rollout: healthy", "stage": "healthy"}}
    body = (
        f": ping\r\n\r\nid: 1\r\nevent: state\r\ndata: {json.dumps(first)}\r\n\r\n: ping\r\n\r\n"
        f"id: 2\r\nevent: message\r\ndata: {json.dumps(second)}\r\n\r\nevent: end\r\n"
        'data: {"job_state": "succeeded"}\r\n\r\n'
    )
    events = list(sse_client(body).follow("x"))
    assert events == [first, second, {"type": "end", "job_state": "succeeded"}]


def test_a_follow_of_an_unknown_job_is_an_api_error():
    try:
        list(sse_client("", status=404).follow("x"))
    except ApiError as exc:
        assert exc.status == 404 and "no job x" in str(exc)
    else:
        raise AssertionError("no ApiError")


def test_validation_errors_read_as_field_paths():
    detail = [
        {"loc": ["body", "learner", "steps"], "msg": "Input should be greater than or equal to 0"},
        {"loc": ["body"], "msg": "Value error, bad"},
    ]
    assert format_detail(detail) == "learner.steps: Input should be greater than or equal to 0; body: Value error, bad"
    assert format_detail("no job x") == "no job x"


def test_a_step_event_shows_progress_and_an_eta():
    line = render.event_line(
        {
            "type": "step",
            "data": {
                "step": 5,
                "reward_mean": 0.25,
                "success_rate": 0.5,
                "approx_kl": 0.001,
                "step_seconds": 2.0,
                "policy_version": 5,
            },
        },
        10,
    )
    assert line == ("step 5/10 [##########..........] reward +0.250 success 50% kl 0.0010 2.0s/step v5 eta 10s")
    assert (
        render.event_line({"type": "state", "data": {"state": "failed", "error": "boom"}}, 10) == "state: failed (boom)"
    )


def test_missing_fields_render_as_dashes():
    line = render.event_line({"type": "step", "data": {"step": 1}}, 2)
    assert "reward -" in line and "success -%" in line


def test_no_token_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.delenv("OMRL_API_TOKEN", raising=False)
    assert main(["list"]) == 2
    assert capsys.readouterr().err == "omrl: no token: pass --token or set OMRL_API_TOKEN\n"


def test_an_unreachable_api_is_reported(capsys):
    assert main(["--api", "http://127.0.0.1:9", "--token", "t", "--timeout", "2", "list"]) == 1
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err


def test_a_server_422_is_one_line_naming_the_field(monkeypatch, capsys, tmp_path):
    """A spec the CLI's models accept but the server's launcher rejects comes back as the API's 422."""

    def submit(self, spec):
        raise ApiError(
            422,
            [
                {
                    "loc": ["body", "resources", "learner", "replicas"],
                    "msg": "the local launcher runs one process of each service",
                }
            ],
        )

    monkeypatch.setattr(JobsClient, "submit", submit)
    spec = tmp_path / "job.yaml"
    spec.write_text("learner: {steps: 2}\n")
    assert main(["--token", "t", "submit", str(spec)]) == 1
    err = capsys.readouterr().err
    assert err == ("omrl: HTTP 422: resources.learner.replicas: the local launcher runs one process of each service\n")


def test_the_live_view_keeps_a_line_per_step_with_eta_and_mismatch():
    import io

    from rich.console import Console

    from services.cli.live import LiveView, duration, eta_seconds

    assert eta_seconds(2, 10, [3.0, 5.0]) == 32.0 and eta_seconds(1, 10, []) is None
    assert [duration(s) for s in (4.4, 75, 3725)] == ["4s", "1m15s", "1h02m"]
    out = io.StringIO()
    with LiveView(4, Console(file=out, width=160, force_terminal=False)) as view:
        view.stage("rollout: healthy after 3s")
        view.step(
            {
                "step": 1,
                "reward_mean": -0.5,
                "success_rate": 0.125,
                "approx_kl": 0.0021,
                "step_seconds": 3.0,
                "mismatch_kl": 0.00123,
                "policy_version": 1,
            }
        )
    lines = out.getvalue().splitlines()
    assert "  rollout: healthy after 3s" in lines
    assert "step 1/4  reward -0.500  success 12%  kl 0.0021  3.0s/step  eta 9s  mismatch 1.2e-03  policy v1" in lines


def test_follow_resumes_after_a_lost_connection_from_the_last_event(capsys):
    """A dropped stream (or one closed before the end event) is reopened from the last event seen, with
    back-off; the events are shown once each and the exit code is the job's outcome."""
    from services.cli.main import follow_job

    step = {"type": "step", "data": {"step": 1, "reward_mean": 0.5}}

    class Client:
        def __init__(self):
            self.calls = []

        def get(self, job_id):
            return {"total_steps": 2}

        def follow(self, job_id, after):
            self.calls.append(after)
            if len(self.calls) == 1:
                yield {**step, "seq": 1}
                raise httpx.ReadError("peer closed")
            if len(self.calls) == 2:
                yield {**step, "seq": 2, "data": {"step": 2}}
                return  # closed without an end event
            yield {"type": "end", "job_state": "succeeded", "seq": 3}

    client = Client()
    assert follow_job(client, "job-1", retries=3, wait_s=0.01) == 0
    assert client.calls == [0, 1, 2]
    out, err = capsys.readouterr()
    assert out.count("step 1/2") == 1 and out.count("step 2/2") == 1 and "job job-1 succeeded" in out
    assert "(connection lost: peer closed; resuming after event 1)" in err


def test_follow_gives_up_after_its_retries():
    from services.cli.main import follow_job

    class Client:
        def get(self, job_id):
            return {"total_steps": 2}

        def follow(self, job_id, after):
            raise httpx.ConnectError("refused")
            yield  # a generator, like the real one

    with pytest.raises(httpx.ConnectError):
        follow_job(Client(), "job-1", retries=2, wait_s=0.001)
