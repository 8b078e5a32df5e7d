"""docker/*.Dockerfile, read as text (no Docker engine here, nothing is built): one image per service,
a CUDA variant where the service uses torch or vLLM, non-root, a healthcheck, the service's own module
as entrypoint, and only paths that exist copied in."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
IMAGES = {  # Dockerfile -> module it runs
    "envs.Dockerfile": "services.envs",
    "reward.Dockerfile": "services.reward",
    "rollout.Dockerfile": "services.rollout",
    "rollout.cuda.Dockerfile": "services.rollout",
    "learner.Dockerfile": "services.learner",
    "learner.cuda.Dockerfile": "services.learner",
    "jobs-api.Dockerfile": "services.jobs",
}


def instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_one_image_per_service_and_cuda_where_torch_or_vllm_runs():
    assert {p.name for p in DOCKER.glob("*.Dockerfile")} == set(IMAGES)


@pytest.mark.parametrize("name, module", IMAGES.items())
def test_image_runs_its_service_as_non_root_with_a_healthcheck(name, module):
    steps = instructions(DOCKER / name)
    final = steps[max(i for i, (word, _) in enumerate(steps) if word == "FROM") :]
    words = dict(final)
    assert re.fullmatch(r"\d+:\d+", words["USER"]) and not words["USER"].startswith("0:")
    entrypoint = json.loads(words["ENTRYPOINT"])
    assert entrypoint[-2:] == ["-m", module] and importlib.util.find_spec(module) is not None
    healthcheck = words["HEALTHCHECK"]
    assert "services.common.healthcheck" in healthcheck and "--start-period=" in healthcheck
    ports = words["EXPOSE"].split()
    cmd = json.loads(words["CMD"])
    for flag, value in zip(cmd[::2], cmd[1::2]):
        if flag in ("--port", "--metrics-port"):
            assert value in ports, (flag, value)


@pytest.mark.parametrize("name", IMAGES)
def test_copied_sources_exist_and_proto_code_is_generated_in_the_build(name):
    steps = instructions(DOCKER / name)
    for word, rest in steps:
        if word == "COPY" and not rest.startswith("--from"):
            *sources, _ = rest.split()
            for source in sources:
                assert (ROOT / source).exists(), source
    assert any(word == "RUN" and "services.common.protogen" in rest for word, rest in steps)


def test_dockerignore_keeps_local_state_out_of_the_build_context():
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".venv", "runs", ".git", ".cache"} <= ignored
    assert not {"services", "proto", "pyproject.toml"} & ignored


def test_compose_builds_each_service_from_its_dockerfile():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for service in ("envs", "reward", "rollout", "learner"):
        build = compose["services"][service]["build"]
        assert build == {"context": ".", "dockerfile": f"docker/{service}.Dockerfile"}


@pytest.mark.parametrize("name", IMAGES)
def test_installed_extras_exist(name):
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for wanted in re.findall(r"\.whl\)\[([a-z0-9,]+)\]", (DOCKER / name).read_text()):
        assert set(wanted.split(",")) <= extras, wanted


def test_the_reward_image_has_cpu_torch_and_transformers_for_the_reward_model():
    import tomllib
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = (DOCKER / "reward.Dockerfile").read_text()
    (installed,) = re.findall(r"\.whl\)\[([a-z0-9,]+)\]", text)
    packages = {Requirement(dep).name for extra in installed.split(",") for dep in extras[extra]}
    assert {"torch", "transformers", "sacrebleu", "math-verify"} <= packages
    torch_pin = re.compile(r'--index-url https://download\.pytorch\.org/whl/cpu "torch==([0-9.]+)"')
    # torch from the CPU index before the extras (PyPI's default wheel carries CUDA), the learner image's version
    assert torch_pin.findall(text) == torch_pin.findall((DOCKER / "learner.Dockerfile").read_text()) != []
    assert text.index("whl/cpu") < text.index(".whl)[")


def test_the_envs_image_runs_the_sandbox_server_too():
    """The python toolset's sandbox server (services/envs/sandbox_server.py, the chart's and compose's `sandbox`) runs
    on the envs image: bubblewrap from apt, fastapi and uvicorn from the extras."""
    import tomllib
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = (DOCKER / "envs.Dockerfile").read_text()
    (installed,) = re.findall(r"\.whl\)\[([a-z0-9,]+)\]", text)
    packages = {Requirement(dep).name for extra in installed.split(",") for dep in extras[extra]}
    assert {"fastapi", "uvicorn"} <= packages
    assert any(
        word == "RUN" and "apt-get install" in rest and "bubblewrap" in rest
        for word, rest in instructions(DOCKER / "envs.Dockerfile")
    )
    assert importlib.util.find_spec("services.envs.sandbox_server") is not None
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose["services"]["sandbox"]["build"]["dockerfile"] == "docker/envs.Dockerfile"
