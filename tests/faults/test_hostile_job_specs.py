"""Hostile job specs against a real job API process (`python -m services.jobs`, local launcher): a token is not a
shell on the host. Commands, modules, classes and files in nested fields, URLs to foreign hosts, every vLLM engine
argument off the job API's allow-list (enumerated from the committed field list of the installed vLLM, which
tests/integration/test_vllm_engine_fields.py keeps current), paths out of the allowed folders, images and volumes,
and oversized bodies: each is refused (4xx, naming the field) before anything is stored or launched. After every
test the job list is empty, the launcher's run folder holds nothing, and the marker file that the spec's commands
and plugin would create does not exist."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from services.common.config import MAX_FREE_FORM_BYTES, MAX_FREE_FORM_DEPTH
from services.common.grpc_server import free_port
from services.engines.vllm_args import JOB_SPEC_ENGINE_ARGS, engine_fields
from tests.support.api_process import JobApiProcess

pytestmark = pytest.mark.faults

TOKEN = "hostile-token"
ALLOWED_HOST = "envs.allowed.test:8000"
ALLOWED_URL = f"http://{ALLOWED_HOST}"


class Api:
    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.marker, self.out = root / "marker", root / "out"
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        (root / "data").mkdir()
        # imported by vLLM's engine core if a spec could name it as a reasoning-parser plugin
        self.plugin = root / "data" / "evil_plugin.py"
        self.plugin.write_text(f"import pathlib\npathlib.Path({str(self.marker)!r}).write_text('ran')\n")
        self.touch = f"touch {self.marker}"

    def start(self) -> Api:
        settings = {
            "OMRL_API_OUTPUT_DIR": str(self.out),
            "OMRL_API_ALLOWED_DATA_ROOTS": json.dumps([str(self.root / "data")]),
            "OMRL_API_ALLOWED_ENV_HOSTS": json.dumps([ALLOWED_HOST]),
            "OMRL_API_POLL_INTERVAL_S": "0.2",
        }
        self.process = JobApiProcess(self.root, self.port, TOKEN, settings).start()
        return self

    def stop(self) -> None:
        self.http.close()
        self.process.stop()

    def submit(self, spec: dict | None = None, content: bytes | None = None) -> httpx.Response:
        if content is not None:
            response = self.http.post("/v1/jobs", content=content, headers={"content-type": "application/json"})
        else:
            response = self.http.post("/v1/jobs", json=spec)
        if response.status_code < 300:  # a regression: stop what it started before the test fails
            self.http.post(f"/v1/jobs/{response.json()['id']}/cancel")
        return response


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    api = Api(tmp_path_factory.mktemp("hostile")).start()
    yield api
    api.stop()


@pytest.fixture(autouse=True)
def nothing_stored_launched_or_run(api):
    yield
    assert api.http.get("/v1/jobs").json()["total"] == 0, "a hostile spec was stored"
    assert not api.out.exists() or not any(api.out.iterdir()), "the launcher started something"
    assert not api.marker.exists(), "a command or plugin of a spec ran"


def refusal(api: Api, spec: dict) -> dict:
    """The first error of a refused spec (4xx); fails on anything else."""
    response = api.submit(spec)
    assert 400 <= response.status_code < 500, (spec, response.status_code, response.text[:500])
    return response.json()["detail"][0]


def agentgym(**options) -> dict:
    return {"env": {"name": "agentgym", "options": {"family": "webshop", "base_url": ALLOWED_URL, **options}}}


# -- commands, modules, classes and files in nested fields -----------------------------------------------------
def test_commands_in_env_options_are_the_operators(api):
    for spec in (
        agentgym(recycle_command=api.touch, recycle_after=1),
        agentgym(recycle_command=f"sh -c '{api.touch}'", base_url=[ALLOWED_URL, ALLOWED_URL + "/b"]),
    ):
        detail = refusal(api, spec)
        assert detail["loc"] == ["body", "env", "options", "recycle_command"] and detail["type"] == "not_allowed"
        assert "operator's deployment" in detail["msg"]


@pytest.mark.parametrize("env", ["corridor", "guess_number", "maze", "wordle", "crafting", "reasoning", "babyai"])
def test_no_env_takes_a_module_class_command_or_file_option(api, env):
    for key, value in [
        ("module", "os"),
        ("env_cls", "evil.module:Env"),
        ("command", api.touch),
        ("plugin", str(api.plugin)),
    ]:
        detail = refusal(api, {"env": {"name": env, "options": {key: value}}})
        assert detail["loc"] == ["body", "env", "options", key] and detail["type"] == "unknown_option", detail


@pytest.mark.parametrize("reward", ["goal", "format", "length_penalty", "env_return"])
def test_no_reward_function_takes_a_module_class_command_or_file_param(api, reward):
    for key, value in [("module", "os"), ("reward_cls", "evil:Reward"), ("command", api.touch)]:
        required = {"max_tokens": 64} if reward == "length_penalty" else {}
        spec = {"reward": {"components": {reward: {"params": {**required, key: value}}}}}
        detail = refusal(api, spec)
        assert detail["loc"] == ["body", "reward", "components", reward, "params", key], detail


def test_datasets_read_only_their_own_files(api):
    for config in (
        {"data_file": "/etc/passwd"},
        {"data_file": "../../../../etc/passwd"},
        {"datasets": [{"name": "spell_backward", "weight": 1.0, "config": {"data_file": "/etc/passwd"}}]},
    ):
        spec = {"env": {"name": "reasoning", "options": {"dataset": "spell_backward", "config": config}}}
        assert refusal(api, spec)["loc"][:4] == ["body", "env", "options", "config"]


# -- every vLLM engine argument off the allow-list -----------------------------------------------------------
def hostile_value(key: str, field: dict, plugin: str):
    """A value of the argument's own JSON type (so the refusal is the policy's, not a type error), hostile
    where it can be: a plugin file that would touch the marker, a class, a path, an endpoint."""
    kinds = set(field["kinds"]) - {"null"}
    if field.get("choices"):
        return field["choices"][-1]
    if "str" in kinds or not kinds:
        if "plugin" in key:
            return plugin
        if key.endswith("cls") or "class" in key or "backend" in key:
            return "tests.evil:Evil"
        if "endpoint" in key or "addr" in key or "url" in key:
            return "http://evil.example:4317"
        return "/etc"
    if "object" in kinds:
        return {"module": "evil", "path": "/etc"}
    if "array" in kinds:
        return ["/etc"]
    return {"bool": True, "int": 1, "float": 1.0}[sorted(kinds)[0]]


def test_every_engine_argument_off_the_allow_list_is_refused(api):
    fields = engine_fields()
    off_list = sorted(set(fields) - JOB_SPEC_ENGINE_ARGS)
    assert len(off_list) > 200 and {"reasoning_parser_plugin", "worker_cls", "trust_remote_code"} <= set(off_list)
    wrong = []
    for key in off_list:
        response = api.submit({"rollout": {"engine_args": {key: hostile_value(key, fields[key], str(api.plugin))}}})
        detail = response.json()["detail"][0] if response.status_code == 422 else {}
        if detail.get("loc") != ["body", "rollout", "engine_args", key]:
            wrong.append(f"{key}: {response.status_code} {response.text[:200]}")
    assert wrong == []


def test_the_arguments_the_issue_named_are_refused_by_the_policy(api):
    """Each passes the config's type check, so what refuses it is the job API's allow-list."""
    named = {
        "reasoning_parser_plugin": str(api.plugin),
        "download_dir": "/",
        "worker_cls": "tests.evil:Worker",
        "scheduler_cls": "tests.evil:Scheduler",
        "tokenizer": "/etc",
        "hf_config_path": "/etc",
        "otlp_traces_endpoint": "http://evil.example:4317",
        "kv_transfer_config": {"kv_connector": "Evil", "kv_connector_module_path": "tests.evil"},
        "hf_overrides": {"architectures": ["Evil"], "auto_map": {"AutoModel": "evil.Model"}},
        "trust_remote_code": True,
        "logits_processors": ["tests.evil:Processor"],
        "io_processor_plugin": "evil",
    }
    for key, value in named.items():
        detail = refusal(api, {"rollout": {"engine_args": {key: value}}})
        assert (detail["loc"], detail["type"]) == (["body", "rollout", "engine_args", key], "not_allowed"), key


# -- URLs, addresses and paths ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data",
        "http://127.0.0.1:6379",
        "http://[::1]:8000",
        "http://localhost:8000",
        "http://envs.allowed.test:8001",
        "http://envs.allowed.test.evil.example:8000",
        "http://evil.example@envs.allowed.test:8000",
        f"{ALLOWED_URL}/x?y=1",
        f"{ALLOWED_URL} --evil",
        "file:///etc/passwd",
        "gopher://envs.allowed.test:8000",
    ],
)
def test_environment_servers_only_on_allowed_hosts(api, url):
    for base_url in (url, [ALLOWED_URL, url]):
        detail = refusal(api, agentgym(base_url=base_url))
        assert detail["loc"] == ["body", "env", "options", "base_url"] and detail["type"] == "not_allowed"


@pytest.mark.parametrize(
    "spec,loc",
    [
        ({"env": {"address": "evil.example:50052"}}, ["env", "address"]),
        ({"reward": {"address": "169.254.169.254:80"}}, ["reward", "address"]),
        ({"rollout": {"addresses": ["127.0.0.1:50051", "evil.example:50051"]}}, ["rollout", "addresses"]),
        ({"stream": {"redis_url": "redis://evil.example:6379/0"}}, ["stream", "redis_url"]),
        ({"resources": {"image": "evil.example/omrl:latest"}}, ["resources", "image"]),
        ({"resources": {"volume_claim": "jobs-api-data"}}, ["resources", "volume_claim"]),
        ({"output_dir": "/tmp"}, ["output_dir"]),
        ({"model": {"path": "/etc"}}, ["model", "path"]),
        ({"model": {"path": "../../etc"}}, ["model", "path"]),
        ({"env": {"data_dir": "/etc"}}, ["env", "data_dir"]),
        ({"env": {"dataset": "/"}}, ["env", "dataset"]),
        ({"learner": {"checkpoint_dir": "/root"}}, ["learner", "checkpoint_dir"]),
        ({"learner": {"export_dir": "/usr/lib/python3"}}, ["learner", "export_dir"]),
    ],
)
def test_addresses_images_volumes_and_paths_are_not_the_callers(api, spec, loc):
    detail = refusal(api, spec)
    assert (detail["loc"], detail["type"]) == (["body", *loc], "not_allowed")


# -- large and deep free-form input ------------------------------------------------------------------------
def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def test_free_form_input_is_bounded(api):
    for options in (
        {"config": {"words": ["x" * 100] * (MAX_FREE_FORM_BYTES // 100)}},
        {"config": {str(i): i for i in range(MAX_FREE_FORM_BYTES // 4)}},
        {"config": nested(MAX_FREE_FORM_DEPTH)},
    ):
        detail = refusal(api, {"env": {"name": "reasoning", "options": options}})
        assert detail["loc"] == ["body", "env", "options"] and detail["type"] == "value_error", detail
    detail = refusal(api, {"rollout": {"engine_args": {"hf_overrides": nested(MAX_FREE_FORM_DEPTH)}}})
    assert "nested deeper" in detail["msg"]


def test_a_body_over_the_limit_is_413(api):
    body = json.dumps({"env": {"options": {"x": "a" * (1 << 20)}}}).encode()
    assert api.submit(content=body).status_code == 413
