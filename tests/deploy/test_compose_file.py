"""docker-compose.yml (and its GPU override) for local development: valid against the Compose
specification (scripts/check_compose.py, the compose-spec library), healthchecks and healthy-only
dependencies, required variables, a run config the services accept, Prometheus and Grafana wired to
the services and dashboards. No Docker engine runs here: nothing of this starts a container."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.common.config import load_config
from services.common.cpu_budget import OPENMP_IDLE
from tests.support import redis_start_script

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ENV = {
    "OMRL_MODEL": "/models/tiny",
    "REDIS_PASSWORD": "pw",
    "GRAFANA_ADMIN_PASSWORD": "admin-pw",
    "OMRL_WEIGHT_TOKEN": "weight-token-1",
}
OUR_SERVICES = {"envs", "reward", "rollout", "learner"}


def check_compose():
    spec = importlib.util.spec_from_file_location("check_compose", ROOT / "scripts/check_compose.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def compose() -> dict:
    return check_compose().interpolate(yaml.safe_load(COMPOSE.read_text()), ENV)


def run_check(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts/check_compose.py"), *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_compose_files_are_valid():
    proc = run_check(COMPOSE, ROOT / "docker-compose.gpu.yml")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda s: s.replace("    shm_size: 2gb\n", "    shm_sise: 2gb\n", 1), "shm_sise"),
        (lambda s: s.replace("start_period: 20s", "start_period: soon", 1), "duration"),
        (
            lambda s: re.sub(r"  envs:\n(.*?)    healthcheck:\n(      .*\n)+", r"  envs:\n\1", s, count=1, flags=re.S),
            "service envs: no healthcheck",
        ),
        (
            lambda s: s.replace("envs: {condition: service_healthy}", "envs: {condition: service_started}"),
            "depends_on envs does not wait for service_healthy",
        ),
    ],
)
def test_the_check_rejects_a_broken_file(tmp_path, breakage, message):
    broken = breakage(COMPOSE.read_text())
    assert broken != COMPOSE.read_text()
    path = tmp_path / "docker-compose.yml"
    path.write_text(broken)
    proc = run_check(path)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr


def test_required_variables_fail_with_their_message():
    text = COMPOSE.read_text()
    assert check_compose().required_variables(text) == set(ENV)
    checker = check_compose()
    with pytest.raises(checker.MissingVariable, match="REDIS_PASSWORD: set REDIS_PASSWORD"):
        checker.interpolate(yaml.safe_load(text), {k: v for k, v in ENV.items() if k != "REDIS_PASSWORD"})


def test_interpolation_follows_compose_rules():
    interpolate = check_compose().interpolate
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET} ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} $$SET $SET", env) == "x d d  $SET x"


def test_every_service_is_healthchecked_and_waits_for_healthy_dependencies(compose):
    services = compose["services"]
    assert {n for n, s in services.items() if "profiles" not in s} == OUR_SERVICES | {"redis", "prometheus", "grafana"}
    for name, service in services.items():
        assert service["healthcheck"]["test"], name
        for dependency in (service.get("depends_on") or {}).values():
            assert dependency["condition"] == "service_healthy", name
    assert set(services["rollout"]["depends_on"]) == {"redis", "envs", "reward"}
    assert set(services["learner"]["depends_on"]) == {"redis", "rollout"}
    for name in OUR_SERVICES:
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "services.common.healthcheck"], name


def command_config(service: dict, tmp_path: Path):
    args = service["command"]
    config_path = next(
        a.split("=", 1)[1] if "=" in a else args[i + 1] for i, a in enumerate(args) if a.startswith("--config")
    )
    host_path = next(v.split(":")[0] for v in service["volumes"] if v.split(":")[1] == config_path)
    overrides = [a.split("=", 1)[1] for a in args if a.startswith("--set=")]
    return load_config(str(ROOT / host_path), overrides)


def test_services_load_the_run_config_with_the_compose_addresses(compose, tmp_path):
    for name in OUR_SERVICES:
        config = command_config(compose["services"][name], tmp_path)
        assert config.env.address == "envs:50052" and config.reward.address == "reward:50053"
        if name in ("rollout", "learner"):
            assert config.model.path == ENV["OMRL_MODEL"]
            assert config.stream.redis_url == "redis://redis:6379/0"  # the password: $REDIS_PASSWORD
    assert "--advertise=rollout:50051" in compose["services"]["rollout"]["command"]


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_the_redis_password_reaches_the_services_only_as_an_env_var(gpu):
    checker, env = check_compose(), {**ENV, "REDIS_PASSWORD": "s3cret-redis-pw"}
    files = [COMPOSE, *([ROOT / "docker-compose.gpu.yml"] if gpu else [])]
    raw = [yaml.safe_load(f.read_text()) for f in files]
    for doc in raw:
        for name, service in doc["services"].items():
            assert "REDIS_PASSWORD" not in json.dumps(service.get("command", [])), name
    merged = checker.interpolate(raw[0], env)
    for doc in raw[1:]:
        merged = checker.merge(merged, checker.interpolate(doc, env))
    for name, service in merged["services"].items():
        assert "s3cret-redis-pw" not in json.dumps(service.get("command", [])), name
    for name in ("rollout", "learner"):
        assert merged["services"][name]["environment"]["REDIS_PASSWORD"] == "s3cret-redis-pw", name


def test_gpu_override_loads_as_a_bf16_cuda_run(tmp_path):
    checker = check_compose()
    merged = checker.merge(
        checker.interpolate(yaml.safe_load(COMPOSE.read_text()), ENV),
        checker.interpolate(yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text()), ENV),
    )
    for name in ("rollout", "learner"):
        service = merged["services"][name]
        config = command_config(service, tmp_path)
        assert config.model.dtype == "bfloat16"
        assert service["build"]["dockerfile"].endswith(".cuda.Dockerfile")
        assert service["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def metrics_port(service: dict) -> int:
    return int(
        next(
            a.split("=", 1)[1] if "=" in a else service["command"][i + 1]
            for i, a in enumerate(service["command"])
            if a.startswith("--metrics-port")
        )
    )


def test_prometheus_scrapes_every_service_with_the_run_label(compose):
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    run = yaml.safe_load((ROOT / "deploy/compose/config.yaml").read_text())["run"]
    jobs = {job["job_name"]: job["static_configs"][0] for job in prom["scrape_configs"]}
    reward_servers = {"reward-model", "judge"}  # each on only with its profile
    assert all(compose["services"][name]["profiles"] == [name] for name in reward_servers)
    assert set(jobs) == OUR_SERVICES | reward_servers
    for name in OUR_SERVICES | reward_servers:
        assert jobs[name]["targets"] == [f"{name}:{metrics_port(compose['services'][name])}"]
        assert jobs[name]["labels"] == {"run": run}
    mounts = compose["services"]["prometheus"]["volumes"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts


def test_grafana_gets_the_datasource_and_the_dashboards(compose):
    grafana = compose["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/openmanus-rl.yml").read_text())
    dashboards_path = provider["providers"][0]["options"]["path"]
    assert mounts[dashboards_path] == "./deploy/grafana/dashboards"
    assert mounts["/etc/grafana/provisioning/datasources"] == "./deploy/grafana/provisioning/datasources"
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == ENV["GRAFANA_ADMIN_PASSWORD"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / "deploy/grafana/dashboards" / Path(home).name).exists()


def test_published_ports_bind_to_loopback_only(compose):
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)


def test_redis_keeps_an_append_only_file_on_a_volume_and_its_password_off_command_lines(compose):
    redis = compose["services"]["redis"]
    script = redis["command"][-1]
    assert redis["command"][:2] == ["sh", "-c"] and "exec redis-server - <<EOF" in script
    assert "appendonly yes" in script and "dir /data" in script and "redis-data:/data" in redis["volumes"]
    assert "redis-data" in compose["volumes"]
    assert redis["environment"] == {"REDISCLI_AUTH": "pw"}  # redis-cli (the healthcheck) reads it from there
    for line in (" ".join(redis["command"]), " ".join(redis["healthcheck"]["test"])):
        assert "pw" not in line.replace("pwd", "") and "--requirepass" not in line and " -a " not in line


@pytest.mark.skipif(not redis_start_script.AVAILABLE, reason="needs redis-server and redis-cli")
def test_the_redis_start_script_takes_any_password_and_keeps_it_off_argv(compose, tmp_path):
    started = redis_start_script.start(compose["services"]["redis"]["command"][-1], tmp_path)
    assert started.authed_ping == "PONG" and "NOAUTH" in started.unauthed_ping
    assert redis_start_script.PASSWORD not in started.argv and started.appendonly == "yes"


def test_services_bind_all_addresses_and_rollout_and_learner_share_the_weight_token(compose):
    for name in OUR_SERVICES:
        env = compose["services"][name]["environment"]
        assert env["OMRL_BIND_HOST"] == "0.0.0.0", name
        assert env["GOMP_SPINCOUNT"] == OPENMP_IDLE["GOMP_SPINCOUNT"], name
        assert env.get("OMRL_WEIGHT_TOKEN") == ("weight-token-1" if name in ("rollout", "learner") else None), name


def test_the_nccl_weight_push_is_one_variable_away(tmp_path):
    """OMRL_WEIGHT_PUSH=nccl: the learner's config validates with the rendezvous at the learner container,
    and both sides bind NCCL/gloo to the compose network's interface."""
    compose = check_compose().interpolate(yaml.safe_load(COMPOSE.read_text()), {**ENV, "OMRL_WEIGHT_PUSH": "nccl"})
    learner = command_config(compose["services"]["learner"], tmp_path).learner
    assert (learner.weight_push, learner.weight_nccl_host, learner.weight_nccl_port) == ("nccl", "learner", 29600)
    for name in ("rollout", "learner"):
        env = compose["services"][name]["environment"]
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"


def test_the_reward_servers_are_off_by_default_and_their_configs_and_the_remote_example_load(compose, tmp_path):
    """`COMPOSE_PROFILES=reward-model` / `judge`: reward services of their own scoring with `reward_model`
    (OMRL_REWARD_MODEL) and `llm_judge` (OMRL_JUDGE_MODEL, on the rollout image for its vLLM); the main reward service
    waits for them only when their profiles are on (`required: false`), and reaches them once config.yaml's commented
    `remote` component is uncommented."""
    services = compose["services"]
    assert {n: s["profiles"] for n, s in services.items() if "profiles" in s} == {
        "reward-model": ["reward-model"],
        "judge": ["judge"],
        "sandbox": ["tools"],
    }
    optional = {"condition": "service_healthy", "required": False}
    assert services["reward"]["depends_on"] == {"reward-model": optional, "judge": optional}
    server, judge = services["reward-model"], services["judge"]
    config = command_config(server, tmp_path)
    assert list(config.reward.components) == ["reward_model"]
    assert config.reward.components["reward_model"].params["path"] == "/models/reward-model"
    judge_config = command_config(judge, tmp_path).reward
    params = judge_config.components["llm_judge"].params
    assert (params["model"], params["policy_tokenizer"]) == ("/models/judge", ENV["OMRL_MODEL"])
    assert params["timeout_s"] < judge_config.timeout_s == config.reward.timeout_s  # late verdicts: the fallback
    assert judge["build"]["dockerfile"] == "docker/rollout.Dockerfile"
    assert judge["entrypoint"] == ["python", "-m", "services.reward"]
    chosen = check_compose().interpolate(
        yaml.safe_load(COMPOSE.read_text()), {**ENV, "OMRL_REWARD_MODEL": "/models/rm", "OMRL_JUDGE_MODEL": "/models/j"}
    )
    assert (
        command_config(chosen["services"]["reward-model"], tmp_path).reward.components["reward_model"].params["path"]
        == "/models/rm"
    )
    assert command_config(chosen["services"]["judge"], tmp_path).reward.components["llm_judge"].params["model"] == (
        "/models/j"
    )
    for service in (server, judge):
        assert "./models:/models:ro" in service["volumes"] and service["environment"]["HF_HOME"] == "/cache/hf"
    text = (ROOT / "deploy/compose/config.yaml").read_text()
    example = re.sub(r"^  # (components:|  \w+: \{)", r"  \1", text, flags=re.M)
    assert example != text
    path = tmp_path / "config.yaml"
    path.write_text(example)
    main = load_config(str(path)).reward
    remote = main.components["remote"].params
    assert remote["servers"] == {"rm": config.reward.address} and config.reward.address == "reward-model:50053"
    assert remote["timeout_s"] == config.reward.timeout_s < main.timeout_s
    assert judge_config.address == "judge:50053"
    for service, address in ((server, config.reward.address), (judge, judge_config.address)):
        assert f"--port={address.split(':')[1]}" in service["command"]


def test_the_sandbox_server_is_off_by_default_and_the_tools_config_runs_the_python_toolset_on_it(tmp_path):
    """`COMPOSE_PROFILES=tools` with `OMRL_RUN_CONFIG=./deploy/compose/tools.yaml`: the python toolset's sandbox server
    on the envs image, with the security options bubblewrap needs and nothing more (no capabilities, no-new-privileges,
    read-only root); the envs service waits for it only with its profile on and sends the same token; the example run
    config loads in every service and points the python toolset at the server."""
    from services.envs.sandbox_server import TOKEN_ENV

    env = {**ENV, "OMRL_RUN_CONFIG": "./deploy/compose/tools.yaml", TOKEN_ENV: "sandbox-token-1"}
    services = check_compose().interpolate(yaml.safe_load(COMPOSE.read_text()), env)["services"]
    sandbox, envs = services["sandbox"], services["envs"]
    assert sandbox["profiles"] == ["tools"]
    assert sandbox["build"] == envs["build"] and sandbox["image"] == envs["image"]
    assert sandbox["entrypoint"] == ["python", "-m", "services.envs.sandbox_server"]
    assert set(sandbox["security_opt"]) == {
        "no-new-privileges:true",
        "seccomp=unconfined",
        "apparmor=unconfined",
        "systempaths=unconfined",
    }
    assert sandbox["cap_drop"] == ["ALL"] and sandbox["read_only"] is True and "privileged" not in sandbox
    command = sandbox["command"]
    port = command[command.index("--port") + 1]
    assert sandbox["healthcheck"]["test"] == [
        "CMD",
        "python",
        "-m",
        "services.common.healthcheck",
        f"http://127.0.0.1:{port}/healthz",
    ]
    assert sandbox["environment"][TOKEN_ENV] == envs["environment"][TOKEN_ENV] == "sandbox-token-1"
    assert envs["depends_on"] == {"sandbox": {"condition": "service_healthy", "required": False}}
    for name in OUR_SERVICES:
        config = command_config(services[name], tmp_path)
        assert config.run == "compose-tools" and config.rollout.agent_loop == "tools", name
        assert config.env.tools["python"].options["endpoint"] == f"http://sandbox:{port}", name
        assert config.env.address == "envs:50052" and config.reward.address == "reward:50053", name


def test_the_sandbox_token_is_not_required_by_the_default_stack_and_the_server_refuses_none(tmp_path):
    """Compose interpolates the services of every profile, so a `:?` token would be required by every `docker compose
    up`; the server itself refuses to start without one (and the toolset refuses to call it without one)."""
    from services.envs.sandbox_server import TOKEN_ENV, create_app
    from services.envs.tools.python import PythonOptions

    text = COMPOSE.read_text()
    assert TOKEN_ENV not in check_compose().required_variables(text)
    services = check_compose().interpolate(yaml.safe_load(text), ENV)["services"]
    assert services["sandbox"]["environment"][TOKEN_ENV] == ""
    with pytest.raises(ValueError, match=TOKEN_ENV):
        create_app(PythonOptions(), "", tmp_path)
