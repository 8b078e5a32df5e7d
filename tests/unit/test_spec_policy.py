"""The job API's spec policy (services/jobs/spec_policy.py): a job spec is data, never code. Commands come from
the deployment, URLs only to allowed hosts, paths only inside allowed folders, engine arguments only from an
allow-list; every plugin's option schema is closed and each of its text fields is marked or reviewed; and every
text field of a job spec is accounted for (a new one fails here until someone decides who may set it)."""

from __future__ import annotations

import json
import types
import typing
from typing import Annotated, Any, ClassVar

import pytest
from pydantic import BaseModel, Field, ValidationError

from services import plugins
from services.common import trust
from services.common.config import TrainConfig, load_config
from services.engines.vllm_args import JOB_SPEC_ENGINE_ARGS
from services.envs.base import EnvOptions, StepResult, TextEnv
from services.envs.registry import ENVS
from services.jobs.settings import JobsSettings
from services.jobs.spec import JobSpec
from services.jobs.spec_policy import SpecNotAllowed, SpecPolicy
from services.launcher.k8s_objects import K8sOptions
from services.launcher.k8s_objects import run_config as k8s_run_config
from services.launcher.local import LocalLauncher, LocalRun
from services.reward.base import RewardFunction
from services.reward.registry import REWARDS

AGENTGYM = {"name": "agentgym", "options": {"family": "textcraft", "base_url": "http://textcraft:8000"}}
RECYCLE = "docker restart textcraft-{port}"


@pytest.fixture
def roots(tmp_path):
    (tmp_path / "data").mkdir()
    return [tmp_path / "data"]


def refused(policy: SpecPolicy, data: dict) -> SpecNotAllowed:
    spec = JobSpec.model_validate(data)
    with pytest.raises(SpecNotAllowed) as info:
        policy.apply(spec)
    return info.value


def with_env(options: dict, name: str = "agentgym") -> dict:
    return {"env": {"name": name, "options": options}}


def tools(kind: str, **options) -> dict:
    return {"env": {"name": "tool_arith", "tools": {"t": {"type": kind, "options": options}}}}


# -- every plugin's options: a closed schema, each text field marked or reviewed ------------------------------
def plugin_schemas() -> dict[tuple[str, str], type[BaseModel]]:
    return {
        (kind, name): plugins.options_model(kind, name)
        for kind in ("env", "reward", "toolset")
        for name in plugins.names(kind)
    }


def models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in models_in(arg)]


def takes_text(annotation: Any) -> bool:
    """Whether a value of this type may be a string anywhere in it (a Literal's fixed strings are not text)."""
    if annotation is str or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Literal or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return False
    if origin is typing.Annotated:
        return takes_text(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, list, dict, tuple, set):
        return any(takes_text(arg) for arg in typing.get_args(annotation) if arg is not Ellipsis)
    return False


def text_fields(model: type[BaseModel], prefix: str = "") -> typing.Iterator[tuple[str, type[BaseModel], str]]:
    """(path, model, field name) of every field that takes text, nested models walked."""
    for name, field in model.model_fields.items():
        for sub in models_in(field.annotation):
            yield from text_fields(sub, f"{prefix}{name}.")
        if takes_text(field.annotation):
            yield f"{prefix}{name}", model, name


REVIEWED_PLUGIN_TEXT = {
    ("env", "agentgym", "family"): "one of services.envs.agentgym.profiles.PROFILES (validated)",
    ("env", "babyai", "level"): "looked up among gymnasium's registered BabyAI- ids before gymnasium.make",
    ("env", "reasoning", "dataset"): "a reasoning-gym dataset name, looked up in its registry",
    ("env", "reasoning", "config"): "its dataset's config fields (sizes, ranges, word lists); bounded FreeForm; the "
    "keys that name a file reasoning-gym reads are bare names of its own files (ReasoningOptions)",
    ("reward", "reward_model", "device"): "a torch device name (torch.device parses it)",
    ("reward", "llm_judge", "prompt"): "the rubric the judge model reads, placeholders checked (reward.verdicts)",
    ("reward", "llm_judge", "yes"): "words looked up in the judge's tokenizer",
    ("reward", "llm_judge", "no"): "words looked up in the judge's tokenizer",
    ("reward", "hinted_action", "hints"): "phrases found in anchor text with `in`, and actions compared with ==",
    ("toolset", "mcp", "headers"): "HTTP headers sent to the MCP server, whose url is a trust.URL of an allowed host",
    ("toolset", "mcp", "prefix"): "text put before the server's tool names as the model sees them",
    ("toolset", "mcp", "include"): "tool names compared with the server's",
    ("toolset", "mcp", "exclude"): "tool names compared with the server's",
    **{
        ("reward", scorer, "key"): "a field name looked up in the task's ground-truth JSON"
        for scorer in ("exact_match", "token_f1", "bleu", "chrf", "math_equiv")
    },
}
"""Unmarked text options, each read and found to be data: a name looked up in a fixed table, or numbers."""


def test_every_plugin_schema_is_closed():
    schemas = plugin_schemas()
    assert {("env", "agentgym"), ("env", "corridor"), ("reward", "goal"), ("reward", "length_penalty")} <= set(schemas)
    for (kind, name), model in schemas.items():
        for sub in [model, *(m for f in model.model_fields.values() for m in models_in(f.annotation))]:
            assert sub.model_config.get("extra") == "forbid", f"{kind} {name!r}: {sub.__name__} takes unknown keys"


def test_every_text_option_of_a_plugin_is_marked_or_reviewed():
    unreviewed = []
    for (kind, name), model in plugin_schemas().items():
        for path, owner, field in text_fields(model):
            if trust.trust_of(owner, field) is None and (kind, name, path) not in REVIEWED_PLUGIN_TEXT:
                unreviewed.append(f"{kind} {name}: {path}")
    assert unreviewed == [], "mark each trust.OPERATOR/URL/PATH, or review it as data in REVIEWED_PLUGIN_TEXT"
    assert trust.trust_of(ENVS.get("agentgym").Options, "recycle_command") == "operator"
    assert trust.trust_of(ENVS.get("agentgym").Options, "base_url") == "url"


# -- every text field of a job spec: who sets it ---------------------------------------------------------------
JOB_SPEC_TEXT = {
    "run": "the launcher: the job id",
    "output_dir": "path in the allowed roots (and the launcher's own)",
    "model.path": "path in the allowed roots, or a hub id",
    "env.name": "registered plugin",
    "env.options": "plugin schema markers, FreeForm bounds",
    "env.address": "refused: the launcher's",
    "env.dataset": "path in the allowed roots",
    "env.data_dir": "path in the allowed roots",
    "rollout.backend": "registered plugin",
    "rollout.addresses": "refused: the launcher's",
    "rollout.engine_args": "allow-list of keys",
    "rollout.action_parser": "registered plugin",
    "rollout.agent_loop": "registered plugin",
    "rollout.tool_parser": "registered plugin",
    "env.tools": "names matching TOOLSET_NAME",
    "env.tools.type": "registered plugin",
    "env.tools.options": "plugin schema markers (of the toolset's type), FreeForm bounds",
    "reward.address": "refused: the launcher's",
    "reward.components": "names matching COMPONENT_NAME, each a registered plugin or naming one in its type",
    "reward.components.params": "plugin schema markers (of the component's type), FreeForm bounds",
    "reward.components.type": "a registered plugin",
    "algorithm.advantage": "registered plugin",
    "algorithm.policy_loss": "registered plugin",
    "learner.checkpoint_dir": "path in the allowed roots (and the launcher's own)",
    "learner.export_dir": "path in the allowed roots",
    "learner.weight_push": "registered plugin",
    "learner.weight_nccl_host": "the launcher: the learner's pod 0 / 127.0.0.1",
    "stream.redis_url": "refused unless allow_spec_redis_url: the server's",
    "stream.prefix": "data: a Redis key prefix under the server's Redis",
    "logging.mlflow_tracking_uri": "refused: the deployment's",
    **{
        f"resources.{c}.{q}": "data: a Kubernetes quantity (pattern)"
        for c in ("learner", "rollout", "envs", "reward")
        for q in ("cpu", "memory")
    },
    "resources.image": "allow-list (allowed_images)",
    "resources.volume_claim": "allow-list (allowed_volume_claims)",
    "schedule.priority_class": "data: a PriorityClass name (DNS pattern)",
    "schedule.node_selector": "data: node labels",
    "schedule.tolerations.key": "data: a taint key",
    "schedule.tolerations.value": "data: a taint value",
}


def test_every_text_field_of_a_job_spec_is_accounted_for():
    found = {path for path, _, _ in text_fields(JobSpec)}
    assert found == set(JOB_SPEC_TEXT), "decide who may set a new text field (launcher, policy, data) and list it"


@pytest.mark.parametrize(
    "data,loc",
    [
        ({"output_dir": "/etc"}, ("output_dir",)),
        ({"model": {"path": "/etc"}}, ("model", "path")),
        ({"env": {"address": "evil.example:50052"}}, ("env", "address")),
        ({"env": {"dataset": "/etc"}}, ("env", "dataset")),
        ({"env": {"data_dir": "/etc"}}, ("env", "data_dir")),
        ({"rollout": {"addresses": ["evil.example:50051"]}}, ("rollout", "addresses")),
        ({"rollout": {"engine_args": {"download_dir": "/etc"}}}, ("rollout", "engine_args", "download_dir")),
        ({"reward": {"address": "evil.example:50053"}}, ("reward", "address")),
        ({"learner": {"checkpoint_dir": "/etc"}}, ("learner", "checkpoint_dir")),
        ({"learner": {"export_dir": "/etc"}}, ("learner", "export_dir")),
        ({"stream": {"redis_url": "redis://evil.example:6379/0"}}, ("stream", "redis_url")),
        ({"logging": {"mlflow_tracking_uri": "http://evil.example:5000"}}, ("logging", "mlflow_tracking_uri")),
        ({"resources": {"image": "evil/omrl:latest"}}, ("resources", "image")),
        ({"resources": {"volume_claim": "jobs-api-data"}}, ("resources", "volume_claim")),
        (with_env({**AGENTGYM["options"], "recycle_command": "touch /tmp/x"}), ("env", "options", "recycle_command")),
        (with_env({"family": "textcraft", "base_url": "http://evil.example:8000"}), ("env", "options", "base_url")),
        (tools("mcp", transport="stdio", command=["sh", "-c", "id"]), ("env", "tools", "t", "options", "command")),
        (tools("mcp", transport="http", url="http://evil.example/mcp"), ("env", "tools", "t", "options", "url")),
        (tools("search", corpus="/etc"), ("env", "tools", "t", "options", "corpus")),
        (tools("python", isolation="none"), ("env", "tools", "t", "options", "isolation")),
        (tools("python", interpreter="/bin/sh"), ("env", "tools", "t", "options", "interpreter")),
    ],
)
def test_what_the_policy_refuses_is_named(roots, data, loc):
    assert refused(SpecPolicy(roots, env_hosts=["textcraft"]), data).loc == loc


# -- env options: commands from the deployment, URLs to allowed hosts -----------------------------------------
def test_a_command_is_the_operators_and_merged_from_the_settings(roots):
    policy = SpecPolicy(roots, env_hosts=["textcraft"], env_options={"agentgym": {"recycle_command": RECYCLE}})
    error = refused(policy, with_env({**AGENTGYM["options"], "recycle_command": "touch /tmp/marker"}))
    assert error.loc == ("env", "options", "recycle_command") and "operator's deployment" in error.message
    spec = policy.apply(JobSpec.model_validate(with_env(AGENTGYM["options"])))
    assert spec.env.options == {**AGENTGYM["options"], "recycle_command": RECYCLE}
    again = policy.apply(JobSpec.model_validate(spec.model_dump(mode="json")))  # a stored spec, resubmitted
    assert again.env.options == spec.env.options
    assert policy.apply(JobSpec.model_validate(with_env({"length": 5}, "corridor"))).env.options == {"length": 5}
    unset = policy.apply(JobSpec.model_validate(with_env({**AGENTGYM["options"], "recycle_command": None})))
    assert unset.env.options["recycle_command"] == RECYCLE, "a caller cannot switch the deployment's command off"


def test_the_deployment_may_name_the_servers_and_the_caller_may_not_override_them_outside_the_allowed_hosts(roots):
    servers = {"base_url": ["http://webshop-0:3000", "http://webshop-1:3000"], "recycle_command": RECYCLE}
    policy = SpecPolicy(roots, env_options={"agentgym": servers})
    spec = policy.apply(JobSpec.model_validate(with_env({"family": "webshop", "base_url": servers["base_url"]})))
    assert spec.env.options["base_url"] == servers["base_url"]
    assert refused(policy, with_env({"family": "webshop", "base_url": "http://webshop-2:3000"})).loc[-1] == "base_url"


@pytest.mark.parametrize(
    "url,ok",
    [
        ("http://textcraft:8000", True),
        ("https://TextCraft/api", True),
        ("http://babyai:9000", True),
        ("http://babyai:9001", False),
        ("http://babyai", False),  # port 80
        ("http://[::1]:8000", True),
        ("http://evil.example:8000", False),
        ("http://textcraft.evil.example:8000", False),
        ("http://evil.example@textcraft:8000", False),
        ("http://textcraft:8000 --evil", False),
        ("http://textcraft:8000/?x=1", False),
        ("http://textcraft:99999", False),
        ("file:///etc/passwd", False),
        ("ftp://textcraft:8000", False),
    ],
)
def test_environment_server_urls_name_allowed_hosts(roots, url, ok):
    policy = SpecPolicy(roots, env_hosts=["textcraft", "babyai:9000", "[::1]:8000"])
    data = with_env({"family": "textcraft", "base_url": [url]})
    if ok:
        assert policy.apply(JobSpec.model_validate(data)).env.options["base_url"] == [url]
    else:
        assert refused(policy, data).loc == ("env", "options", "base_url")


def test_no_allowed_hosts_means_no_caller_urls(roots):
    error = refused(SpecPolicy(roots), with_env({"family": "textcraft", "base_url": "http://127.0.0.1:8000"}))
    assert "allows: none" in error.message


def test_the_deployments_settings_are_checked_when_the_api_starts(roots):
    with pytest.raises(ValueError, match="recycle_comand not options of env 'agentgym'"):
        SpecPolicy(roots, env_options={"agentgym": {"recycle_comand": "x"}})
    with pytest.raises(KeyError, match="agentgymm"):
        SpecPolicy(roots, env_options={"agentgymm": {}})
    with pytest.raises(ValueError, match="extra_engine_args: 'max_num_batch_tokens'"):
        SpecPolicy(roots, extra_engine_args=["max_num_batch_tokens"])
    with pytest.raises(ValueError, match="extra_engine_args: 'worker_extension_cls' is set by the rollout backend"):
        SpecPolicy(roots, extra_engine_args=["worker_extension_cls"])
    with pytest.raises(ValueError, match="allowed_env_hosts"):
        SpecPolicy(roots, env_hosts=["http://textcraft:8000"])


def test_the_settings_reach_the_policy(roots, tmp_path, monkeypatch):
    monkeypatch.setenv("OMRL_API_ALLOWED_ENV_HOSTS", '["textcraft:8000"]')
    monkeypatch.setenv("OMRL_API_ENV_OPTIONS", json.dumps({"agentgym": {"recycle_command": RECYCLE}}))
    monkeypatch.setenv("OMRL_API_EXTRA_ENGINE_ARGS", '["enable_expert_parallel"]')
    monkeypatch.setenv("OMRL_API_ALLOWED_IMAGES", '["reg.io/omrl/custom:1"]')
    monkeypatch.setenv("OMRL_API_ALLOWED_VOLUME_CLAIMS", '["omrl-data"]')
    policy = SpecPolicy.from_settings(JobsSettings(token="t", allowed_data_roots=roots, output_dir=tmp_path / "out"))
    spec = policy.apply(
        JobSpec.model_validate(
            {
                **with_env(AGENTGYM["options"] | {"base_url": "http://textcraft:8000"}),
                "rollout": {"engine_args": {"enable_expert_parallel": True}},
                "resources": {"image": "reg.io/omrl/custom:1", "volume_claim": "omrl-data"},
            }
        )
    )
    assert spec.env.options["recycle_command"] == RECYCLE


@pytest.mark.parametrize("name", ["/etc/passwd", "../../../etc/passwd", "..", "a/b.txt", "C:\\x", ""])
def test_reasoning_gym_reads_only_its_own_files(name):
    for config in (
        {"data_file": name},
        {"datasets": [{"name": "spell_backward", "weight": 1, "config": {"data_file": name}}]},
        {"static_font": name},
    ):
        with pytest.raises(ValidationError, match="not the name of a file reasoning-gym ships"):
            JobSpec.model_validate(with_env({"dataset": "spell_backward", "config": config}, "reasoning"))
    assert JobSpec.model_validate(
        with_env({"dataset": "spell_backward", "config": {"data_file": "words3to10.txt"}}, "reasoning")
    )


# -- a throwaway env and reward function with marked fields: the walk and the path check -----------------------
class _Files(BaseModel):
    model_config = {"extra": "forbid"}
    vocabulary: str | None = Field(None, json_schema_extra=trust.PATH)


class _ProbeOptions(EnvOptions):
    files: _Files = Field(default_factory=_Files)
    mirrors: list[str] = Field(default_factory=list, json_schema_extra=trust.URL)
    plugin: str | None = Field(None, json_schema_extra=trust.OPERATOR)


class _ProbeEnv(TextEnv):
    Options: ClassVar[type[EnvOptions]] = _ProbeOptions

    def reset(self, task_index: int, options: dict) -> str:
        return ""

    def step(self, action: str) -> StepResult:
        return StepResult("")


class _ProbeReward(RewardFunction):
    name = "policy_probe"

    def __init__(self, judge: Annotated[str, Field(json_schema_extra=trust.URL)] = ""):
        self.judge = judge

    def __call__(self, traj) -> float:
        return 0.0


class _OpenReward(RewardFunction):
    name = "policy_open"

    def __init__(self, **params: Any):
        self.params = params

    def __call__(self, traj) -> float:
        return 0.0


@pytest.fixture
def probes():
    ENVS.register("policy_probe")(_ProbeEnv)
    REWARDS.register("policy_probe")(_ProbeReward)
    REWARDS.register("policy_open")(_OpenReward)
    yield
    ENVS.unregister("policy_probe")
    REWARDS.unregister("policy_probe")
    REWARDS.unregister("policy_open")


def test_marked_fields_are_found_in_nested_models_and_lists(roots, probes):
    policy = SpecPolicy(roots, env_hosts=["mirror"])
    inside = str(roots[0] / "words.txt")
    ok = with_env({"files": {"vocabulary": inside}, "mirrors": ["http://mirror:80"]}, "policy_probe")
    assert policy.apply(JobSpec.model_validate(ok)).env.options["files"]["vocabulary"] == inside
    for options, loc in [
        ({"files": {"vocabulary": "/etc/passwd"}}, ("env", "options", "files", "vocabulary")),
        ({"files": {"vocabulary": str(roots[0] / ".." / "x")}}, ("env", "options", "files", "vocabulary")),
        ({"mirrors": ["http://mirror", "http://evil.example"]}, ("env", "options", "mirrors")),
        ({"plugin": "evil.module:Class"}, ("env", "options", "plugin")),
    ]:
        assert refused(policy, with_env(options, "policy_probe")).loc == loc


def test_reward_params_are_walked_too_and_an_open_schema_takes_only_what_it_declares(roots, probes):
    policy = SpecPolicy(roots, env_hosts=["judge:8000"])
    params = {"policy_probe": {"params": {"judge": "http://judge:8000/score"}}}
    assert policy.apply(JobSpec.model_validate({"reward": {"components": params}}))
    error = refused(policy, {"reward": {"components": {"policy_probe": {"params": {"judge": "http://evil.example"}}}}})
    assert error.loc == ("reward", "components", "policy_probe", "params", "judge")
    error = refused(policy, {"reward": {"components": {"policy_open": {"params": {"command": "touch x"}}}}})
    assert error.loc == ("reward", "components", "policy_open", "params", "command")


def test_a_reward_model_is_a_folder_inside_the_allowed_ones_or_a_hub_id(roots):
    def spec(path):
        return {"reward": {"components": {"reward_model": {"params": {"path": path, "policy_tokenizer": path}}}}}

    policy = SpecPolicy(roots)
    assert policy.apply(JobSpec.model_validate(spec(str(roots[0] / "rm"))))
    assert policy.apply(JobSpec.model_validate(spec("OpenAssistant/reward-model-deberta-v3-large")))
    for path in ("/etc", str(roots[0] / ".." / "rm")):
        assert refused(policy, spec(path)).loc == ("reward", "components", "reward_model", "params", "path")


# -- engine arguments, images, volumes, addresses ----------------------------------------------------------------
def test_engine_args_on_the_allow_list_pass_and_the_operator_widens_it(roots):
    args = {"max_num_batched_tokens": 8192, "kv_cache_dtype": "fp8", "enable_prefix_caching": False}
    assert set(args) <= JOB_SPEC_ENGINE_ARGS
    assert SpecPolicy(roots).apply(JobSpec.model_validate({"rollout": {"engine_args": args}}))
    spec = {"rollout": {"engine_args": {"enable_expert_parallel": True}}}
    error = refused(SpecPolicy(roots), spec)
    assert error.loc == ("rollout", "engine_args", "enable_expert_parallel")
    assert "OMRL_API_EXTRA_ENGINE_ARGS" in error.message and "max_num_batched_tokens" in error.message
    assert SpecPolicy(roots, extra_engine_args=["enable_expert_parallel"]).apply(JobSpec.model_validate(spec))


def test_images_and_volume_claims_come_from_the_operators_lists(roots):
    policy = SpecPolicy(roots, images=["reg.io/omrl/custom:1"], volume_claims=["omrl-data"])
    assert policy.apply(JobSpec.model_validate({"resources": {"image": "reg.io/omrl/custom:1"}}))
    assert policy.apply(JobSpec.model_validate({"resources": {"volume_claim": "omrl-data"}}))
    assert refused(policy, {"resources": {"image": "reg.io/omrl/custom:2"}}).loc == ("resources", "image")
    assert refused(policy, {"resources": {"volume_claim": "other"}}).loc == ("resources", "volume_claim")


def test_addresses_at_their_defaults_pass(roots):
    """A dumped run config repeats every default: only a value the caller changed is refused."""
    dumped = JobSpec().model_dump(mode="json", exclude={"resources", "schedule"})
    assert SpecPolicy(roots).apply(JobSpec.model_validate(dumped))


def test_the_launchers_set_addresses_and_the_rendezvous_host_themselves(tmp_path):
    data = {"learner": {"weight_push": "nccl", "weight_nccl_host": "evil.example"}}
    local = LocalLauncher(output_dir=tmp_path).run_config("job-1", JobSpec.model_validate(data))
    assert (local.run, local.learner.weight_nccl_host) == ("job-1", "127.0.0.1")
    run = LocalRun(TrainConfig.model_validate(with_addresses()), say=lambda _: None)
    run._assign_addresses()
    for address in (run.config.env.address, run.config.reward.address, *run.config.rollout.addresses):
        assert address.startswith("127.0.0.1:")
    for workload, host in [("Job", "job-1-learner-0.job-1-learner"), ("JobSet", "job-1-learner-0-0.job-1-jobset")]:
        config = k8s_run_config("job-1", JobSpec.model_validate(data), K8sOptions(workload=workload))
        assert config.learner.weight_nccl_host == host
        assert (config.env.address, config.reward.address) == ("job-1-envs:50052", "job-1-reward:50053")


def with_addresses() -> dict:
    return {
        "env": {"address": "evil.example:1"},
        "reward": {"address": "evil.example:2"},
        "rollout": {"addresses": ["evil.example:3"]},
    }


def test_the_local_cli_keeps_every_engine_argument_and_option():
    """The policy is the job API's: the operator's own CLI runs take what the config checks allow."""
    config = load_config(
        None,
        [
            "rollout.engine_args={download_dir: /models, enable_expert_parallel: true}",
            "env.name=agentgym",
            f"env.options={{family: webshop, base_url: 'http://127.0.0.1:3000', recycle_command: '{RECYCLE}'}}",
        ],
    )
    assert config.rollout.engine_args["download_dir"] == "/models"
    assert config.env.options["recycle_command"] == RECYCLE
    with pytest.raises(ValidationError, match="set by the rollout backend"):
        load_config(None, ["rollout.engine_args={worker_extension_cls: evil.Ext}"])


def test_every_string_marker_is_one_the_policy_knows():
    assert {m["trust"] for m in (trust.OPERATOR, trust.URL, trust.PATH, trust.MODEL)} == set(
        typing.get_args(trust.Trust)
    )
