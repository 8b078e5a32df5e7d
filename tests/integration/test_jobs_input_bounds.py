"""Bounded input at the job API's HTTP layer, over real HTTP (uvicorn on a free port): JSON nested deeper
than the limit is a 400 wherever it sits in the body, before anything parses it; input deep enough to reach
validation is echoed cut short; bodies over the size limit are a 413. After each, the next request on the
same client succeeds, on the same keep-alive connection where the body was read whole."""

import json

import httpx
import pytest

from services.jobs.app import create_app
from services.jobs.errors import CUT, ECHO_DEPTH
from services.jobs.middleware import json_depth
from services.jobs.settings import JobsSettings
from tests.support.fake_launcher import FakeLauncher
from tests.support.live_api import LiveApi

TOKEN = "bounds-token"
MAX_DEPTH = 64
DEPTHS = [100, 500, 999, 5000]
JSON = {"content-type": "application/json"}


def nested(levels: int) -> str:
    return "[" * levels + "]" * levels


def body_with(where: str, levels: int) -> bytes:
    """A job spec whose `where` holds `levels` nested arrays (`top`: the body is those arrays)."""
    if where == "top":
        return nested(levels).encode()
    if where == "env.options":
        return f'{{"env": {{"options": {{"size": {nested(levels)}}}}}}}'.encode()
    return f'{{"rollout": {{"engine_args": {{"hf_overrides": {{"x": {nested(levels)}}}}}}}}}'.encode()


def live_api(root, **settings):
    app_settings = JobsSettings(
        token=TOKEN, db=root / "jobs.sqlite", max_body_bytes=64 * 1024, output_dir=root / "out", **settings
    )
    return LiveApi(create_app(app_settings, launcher=FakeLauncher(("running",))))


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    with (
        live_api(tmp_path_factory.mktemp("bounds"), max_json_depth=MAX_DEPTH) as live,
        httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=20) as client,
    ):
        yield client


def local_port(response: httpx.Response) -> int:
    """The client's port of the connection the response came on."""
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def then_a_normal_submit_succeeds(http: httpx.Client, previous: httpx.Response) -> None:
    ok = http.post("/v1/jobs", json={"learner": {"steps": 1}})
    assert ok.status_code == 201, ok.text
    assert local_port(ok) == local_port(previous), "the connection was not kept"


@pytest.mark.parametrize("levels", DEPTHS)
@pytest.mark.parametrize("where", ["env.options", "engine_args.hf_overrides", "top"])
def test_json_nested_too_deep_is_a_400_and_the_connection_stays_usable(http, where, levels):
    response = http.post("/v1/jobs", content=body_with(where, levels), headers=JSON)
    assert response.status_code == 400, response.text[:300]
    assert response.json() == {"detail": f"request body: JSON nested deeper than {MAX_DEPTH} levels"}
    then_a_normal_submit_succeeds(http, response)


def test_brackets_inside_strings_do_not_count(http):
    spec = {"run": "brackets", "env": {"options": {"hint": "[{" * 5000 + '\\"'}}, "learner": {"steps": 1}}
    response = http.post("/v1/jobs", content=json.dumps(spec).encode(), headers=JSON)
    assert response.status_code == 422, response.text[:300]  # a wrong option value, not a depth error
    assert response.json()["detail"][0]["loc"][:3] == ["body", "env", "options"]


def test_a_route_without_a_body_is_guarded_too(http):
    response = http.post("/v1/jobs/some-job/cancel", content=nested(MAX_DEPTH + 1).encode(), headers=JSON)
    assert response.status_code == 400 and "nested deeper" in response.json()["detail"]
    then_a_normal_submit_succeeds(http, response)


def test_input_just_under_the_limit_is_validated_and_echoed_cut_short(http):
    response = http.post("/v1/jobs", content=body_with("env.options", MAX_DEPTH - 4), headers=JSON)
    assert response.status_code == 422, response.text[:300]
    echoed = json.dumps([error["input"] for error in response.json()["detail"]])
    assert json_depth(echoed.encode()) <= 1 + ECHO_DEPTH and json.dumps(CUT) in echoed
    then_a_normal_submit_succeeds(http, response)


@pytest.mark.parametrize("where", ["env.options", "engine_args.hf_overrides"])
def test_deep_input_that_reaches_validation_is_a_4xx_not_a_500(tmp_path, where):
    """With the limit raised to its maximum, 500 levels reach the parser, validation and the error handler."""
    with (
        live_api(tmp_path, max_json_depth=512) as live,
        httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=20) as client,
    ):
        response = client.post("/v1/jobs", content=body_with(where, 500), headers=JSON)
        assert 400 <= response.status_code < 500, response.text[:300]
        assert len(response.content) < 10_000  # the echo is cut, not 500 levels of brackets
        then_a_normal_submit_succeeds(client, response)


def test_a_body_over_the_size_limit_is_a_413_and_the_next_request_succeeds(http):
    big = json.dumps({"env": {"options": {"blob": "x" * 70_000}}}).encode()
    announced = http.post("/v1/jobs", content=big, headers=JSON)
    assert announced.status_code == 413 and "larger than 65536 bytes" in announced.json()["detail"]
    assert http.post("/v1/jobs", json={"learner": {"steps": 1}}).status_code == 201
    streamed = http.post("/v1/jobs", content=iter([big[:40_000], big[40_000:]]), headers=JSON)
    assert streamed.status_code == 413
    assert http.post("/v1/jobs", json={"learner": {"steps": 1}}).status_code == 201
