"""The CLI's pieces that need no server: SSE parsing, error and progress rendering, argument handling."""
from services.cli import render
from services.cli.client import format_detail, parse_sse
from services.cli.main import main


def test_server_sent_events_are_parsed_with_pings_and_ids_skipped():
    lines = [": ping", "id: 1", "event: state", 'data: {"a": 1}', "", "id: 2", "event: step", "data: line one",
             "data: line two", "", ": ping", "", "event: end", "data:{}", ""]
    assert list(parse_sse(iter(lines))) == [("state", '{"a": 1}'), ("step", "line one\nline two"), ("end", "{}")]


def test_validation_errors_read_as_field_paths():
    detail = [{"loc": ["body", "learner", "steps"], "msg": "Input should be greater than or equal to 0"},
              {"loc": ["body"], "msg": "Value error, bad"}]
    assert format_detail(detail) == "learner.steps: Input should be greater than or equal to 0; body: Value error, bad"
    assert format_detail("no job x") == "no job x"


def test_a_step_event_shows_progress_and_an_eta():
    line = render.event_line({"type": "step", "data": {"step": 5, "reward_mean": 0.25, "success_rate": 0.5,
                                                       "approx_kl": 0.001, "step_seconds": 2.0, "policy_version": 5}}, 10)
    assert line == ("step 5/10 [##########..........] reward +0.250 success 50% kl 0.0010 2.0s/step v5 eta 10s")
    assert render.event_line({"type": "state", "data": {"state": "failed", "error": "boom"}}, 10) == "state: failed (boom)"


def test_missing_fields_render_as_dashes():
    line = render.event_line({"type": "step", "data": {"step": 1}}, 2)
    assert "reward -" in line and "success -%" in line


def test_no_token_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.delenv("OMRL_API_TOKEN", raising=False)
    assert main(["list"]) == 2
    assert "no token" in capsys.readouterr().err


def test_an_unreachable_api_is_reported(capsys):
    assert main(["--api", "http://127.0.0.1:9", "--token", "t", "--timeout", "2", "list"]) == 1
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err


def test_a_bad_spec_file_fails_before_sending(tmp_path, capsys):
    spec = tmp_path / "job.yaml"
    spec.write_text("learner: {steps: -3}\n")
    assert main(["--api", "http://127.0.0.1:9", "--token", "t", "submit", str(spec)]) == 2
    assert "learner.steps" in capsys.readouterr().err
