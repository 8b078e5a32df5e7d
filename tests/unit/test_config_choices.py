"""Plugin choices and their options fail when a config is parsed, naming the field and what is valid."""

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.cli.main import main as omrl
from services.common import choices
from services.common.config import load_config
from services.common.config_errors import error_lines
from services.envs.registry import ENVS
from services.jobs.spec import JobSpec
from services.reward.registry import REWARDS

ROOT = Path(__file__).resolve().parents[2]
SPEC_FILES = sorted(
    [*ROOT.glob("configs/*.yaml"), *ROOT.glob("docs/job-examples/*.yaml"), ROOT / "deploy/compose/config.yaml"]
)


def error_of(overrides: list[str]) -> tuple[tuple, str]:
    with pytest.raises(ValidationError) as info:
        load_config(None, overrides, schema=JobSpec)
    first = info.value.errors()[0]
    return first["loc"], first["msg"]


@pytest.mark.parametrize(
    "override,loc,words",
    [
        (
            "algorithm.advantage=grpoo",
            ("algorithm", "advantage"),
            "'grpoo' is not one of: gae, gigpo, grpo, opo, reinforce_plus_plus, reinforce_plus_plus_baseline, "
            "remax, rloo",
        ),
        ("env.name=corridorr", ("env", "name"), "'corridorr' is not one of: agentgym, babyai, corridor,"),
        ("rollout.action_parser=xml", ("rollout", "action_parser"), "'xml' is not one of: xml_action"),
        ("rollout.backend=sglang", ("rollout", "backend"), "'sglang' is not one of: vllm"),
        ("learner.weight_push=mpi", ("learner", "weight_push"), "'mpi' is not one of: grpc, nccl, none"),
        (
            "reward.components={goall: {}}",
            ("reward", "components", "goall", "[key]"),
            "'goall' is not one of: bleu, chrf, env_return, exact_match, format, goal, hinted_action,",
        ),
        (
            "env.options={lenght: 5}",
            ("env", "options", "lenght"),
            "unknown option 'lenght' of env 'corridor'; known: distance, distances, hint, length, max_turns",
        ),
        ("env.options={length: many}", ("env", "options", "length"), "Input should be a valid integer"),
        (
            "reward.components={goal: {params: {wieght: 2}}}",
            ("reward", "components", "goal", "params", "wieght"),
            "unknown param 'wieght' of reward function 'goal'; known: none",
        ),
        (
            "reward.components={length_penalty: {params: {max_tokens: '64'}}}",
            ("reward", "components", "length_penalty", "params", "max_tokens"),
            "Input should be a valid integer",
        ),
        (
            "reward.components={length_penalty: {params: {}}}",
            ("reward", "components", "length_penalty", "params", "max_tokens"),
            "Field required",
        ),
    ],
)
def test_a_bad_choice_or_option_names_the_field_and_the_valid_ones(override, loc, words):
    got_loc, msg = error_of([override])
    assert got_loc == loc and words in msg


def test_options_are_checked_against_the_chosen_env():
    assert "known: guide, hint, show_map" in error_of(["env.name=maze", "env.options={length: 5}"])[1]
    load_config(None, ["env.name=maze", "env.options={size: 5}"])


def test_agentgym_options_are_its_own_closed_set():
    """AgentGym's options configure our client of the remote server (nothing is forwarded as is), so
    they stay closed like every other env's."""
    good = ["env.name=agentgym", "env.options={family: textcraft, base_url: 'http://127.0.0.1:8000'}"]
    assert load_config(None, good).env.options["family"] == "textcraft"
    assert error_of(["env.name=agentgym"]) == (("env", "options", "family"), "Field required")
    assert (
        "unknown AgentGym family 'textcraf'"
        in error_of(["env.name=agentgym", "env.options={family: textcraf, base_url: 'http://x:1'}"])[1]
    )


def test_good_params_pass_and_the_options_are_kept_as_written():
    config = load_config(
        None, ["reward.components={length_penalty: {params: {max_tokens: 8}}, goal: {}}", "env.options={length: 5}"]
    )
    assert config.reward.components["length_penalty"].params == {"max_tokens": 8}
    assert config.env.options == {"length": 5}


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_spec_still_validates(path):
    load_config(str(path), schema=JobSpec)


def test_a_reward_registered_by_a_plugin_module_is_known_through_omrl_plugins(tmp_path, monkeypatch):
    (tmp_path / "omrl_choices_plugin.py").write_text(
        "from services.reward.base import RewardFunction\n"
        "from services.reward.registry import REWARDS\n"
        "@REWARDS.register('choices_probe')\n"
        "class Probe(RewardFunction):\n"
        "    def __init__(self, scale: float = 1.0):\n"
        "        self.scale = scale\n"
        "    def __call__(self, traj):\n"
        "        return self.scale\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("OMRL_PLUGINS", "omrl_choices_plugin")
    monkeypatch.setattr(choices, "_imported_plugins", set())
    try:
        config = load_config(None, ["reward.components={choices_probe: {params: {scale: 2}}}"])
        assert config.reward.components["choices_probe"].params == {"scale": 2}
        assert (
            "unknown param 'scal' of reward function 'choices_probe'; known: scale"
            in error_of(["reward.components={choices_probe: {params: {scal: 2}}}"])[1]
        )
    finally:
        REWARDS.unregister("choices_probe")
        sys.modules.pop("omrl_choices_plugin", None)


def test_parsing_a_config_imports_no_torch_or_vllm():
    code = (
        "import sys; import services.plugins; from services.common.config import load_config; "
        "load_config(None, ['env.options={length: 5}']); "
        "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_error_lines_name_each_field_once_per_line():
    with pytest.raises(ValidationError) as info:
        load_config(None, ["algorithm.advantage=grpoo", "env.name=corridorr"])
    assert sorted(error_lines(info.value)) == [
        "algorithm.advantage: 'grpoo' is not one of: gae, gigpo, grpo, opo, reinforce_plus_plus, "
        "reinforce_plus_plus_baseline, remax, rloo",
        "env.name: 'corridorr' is not one of: agentgym, babyai, corridor, crafting, guess_number, maze, "
        "reasoning, tool_arith, tool_chain, tool_fix, tool_lookup, wordle",
    ]


def test_omrl_validate_says_ok_or_lists_the_errors(tmp_path, capsys):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("env: {name: maze, options: {size: 5}}\nlearner: {steps: 3}\n")
    bad.write_text("algorithm: {advantage: grpoo}\nenv: {options: {lenght: 5}}\n")
    assert omrl(["validate", str(good)]) == 0
    assert capsys.readouterr().out == "ok\n"
    assert omrl(["validate", str(bad)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("omrl: ") for line in err)
    assert any(line.startswith("omrl: algorithm.advantage: 'grpoo' is not one of:") for line in err)
    assert any(line.startswith("omrl: env.options.lenght: unknown option 'lenght' of env 'corridor'") for line in err)
    assert omrl(["validate", str(tmp_path / "missing.yaml")]) == 1


def test_omrl_submit_rejects_a_bad_plugin_before_sending(tmp_path, capsys):
    spec = tmp_path / "job.yaml"
    spec.write_text("learner: {steps: 3}\n")
    assert (
        omrl(["--api", "http://127.0.0.1:9", "--token", "t", "submit", str(spec), "--set", "env.name=corridorr"]) == 2
    )
    assert capsys.readouterr().err.startswith("omrl: env.name: 'corridorr' is not one of: agentgym,")


def test_the_launcher_prints_one_line_naming_the_field(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "services.launcher", "train", "--set", "algorithm.advantage=grpoo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines() == [
        "config error: algorithm.advantage: 'grpoo' is not one of: gae, gigpo, grpo, opo, reinforce_plus_plus, "
        "reinforce_plus_plus_baseline, remax, rloo"
    ]


@pytest.mark.parametrize(
    "module", ["services.envs", "services.reward", "services.rollout", "services.learner", "services.envs.datasets"]
)
def test_each_service_checks_the_plugins_of_every_other_service(module):
    """A service's own process loads every registry before it parses its config (`services.plugins`, which the
    package `services.common` cannot import): the plugin kinds of the layers above it are checked there too."""
    bad = ["algorithm.advantage=grpoo", "rollout.backend=sglang", "reward.components={goall: {}}", "env.name=x"]
    out = subprocess.run(
        [sys.executable, "-m", module, *(arg for item in bad for arg in ("--set", item))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    fields = sorted(line.split(": ")[2] for line in out.stderr.splitlines())
    assert fields == ["algorithm.advantage", "env.name", "reward.components.goall", "rollout.backend"], out.stderr


def test_an_env_whose_dependencies_are_missing_here_is_left_to_the_env_service():
    ENVS.register_lazy("choices_needs_a_package", "omrl_package_not_installed_here")
    try:
        config = load_config(None, ["env.name=choices_needs_a_package", "env.options={anything: 1}"])
        assert config.env.options == {"anything": 1}
    finally:
        ENVS.unregister("choices_needs_a_package")
