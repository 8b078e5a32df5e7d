"""Config on the command line (omrl and the launcher): a flag per field with its docstring as help, layered
sources remembered per value, `omrl config show/explain`, and every bad flag, override, value or file as one
line naming the field, with nothing sent or started."""

import json
from pathlib import Path

import pytest

from services.cli.client import JobsClient
from services.cli.main import main as omrl
from services.common.config import TrainConfig
from services.common.config_cli import ConfigError, ConfigFlags, Parser, UsageError, resolve, walk
from services.jobs.spec import JobSpec
from services.launcher import __main__ as launcher

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_api(monkeypatch):
    """Any request to the job API fails the test: a bad spec must never be sent."""

    def refuse(*args, **kwargs):
        raise AssertionError("the CLI contacted the job API")

    monkeypatch.setattr(JobsClient, "_call", refuse)
    monkeypatch.setattr(JobsClient, "follow", refuse)


@pytest.fixture
def nothing_starts(monkeypatch):
    """The launcher must reject a bad config before it builds a model or starts a process."""
    from services.launcher import local

    def refuse(self, *args, **kwargs):
        raise AssertionError("the launcher started a run")

    monkeypatch.setattr(local.LocalRun, "run", refuse)
    monkeypatch.setattr(local.LocalRun, "start", refuse)


def flags_for(schema=TrainConfig, **kwargs):
    parser = Parser(prog="t")
    return parser, ConfigFlags(parser, schema, **kwargs)


def test_every_field_is_a_flag_with_its_docstring_as_help():
    parser, _ = flags_for(JobSpec)
    text = " ".join(parser.format_help().split())  # argparse wraps help at the terminal width
    assert "--algorithm.advantage str" in text and "Registered advantage estimator" in text
    assert "One of: gae, gigpo, grpo, opo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, rloo." in text
    assert "--resources.learner.gpus int" in text and "GPUs per pod" in text
    assert "--learner.steps int" in text and "Policy updates to run. (default: 40)" in text
    assert "default factory" not in text  # factory defaults are shown as their values


def test_nested_flags_parse_into_the_config():
    parser, flags = flags_for(shortcuts=True)
    args = parser.parse_args(
        [
            "--algorithm.advantage",
            "rloo",
            "--env.options",
            '{"length": 5}',
            "--steps",
            "3",
            "--model",
            "some/model",
            "--rollout.enforce_eager",
            "false",
            "--reward.components",
            '{"goal": {"weight": 2}}',
        ]
    )
    config = flags.resolve(args, environ={}).config
    assert config.algorithm.advantage == "rloo" and config.env.options == {"length": 5}
    assert config.learner.steps == 3 and config.model.path == "some/model" and config.rollout.enforce_eager is False
    assert set(config.reward.components) == {"goal"} and config.reward.components["goal"].weight == 2


def test_layers_apply_in_order_and_each_value_knows_its_source(tmp_path):
    spec = tmp_path / "run.yaml"
    spec.write_text("learner: {steps: 7, nproc: 1}\nalgorithm: {lr: 0.01}\nrollout: {group_size: 4}\n")
    resolved = resolve(
        JobSpec,
        str(spec),
        ["algorithm.lr=0.02", "rollout.top_k=5"],
        {"rollout": {"top_k": "6"}},
        environ={
            "OMRL_CONFIG__ALGORITHM__LR": "0.03",
            "OMRL_CONFIG__LEARNER__STEPS": "9",
            "OMRL_API_TOKEN": "not config",
        },
    )
    config = resolved.config
    assert (config.learner.steps, config.algorithm.lr, config.rollout.top_k) == (9, 0.02, 6)
    assert [
        resolved.source(p)
        for p in (
            "learner.nproc",
            "learner.steps",
            "algorithm.lr",
            "rollout.top_k",
            "rollout.group_size",
            "algorithm.advantage",
        )
    ] == ["file", "env", "flag", "flag", "file", "default"]


def test_a_value_the_schema_derives_is_marked_derived():
    resolved = resolve(JobSpec, None, ["resources.envs.replicas=3"], environ={})
    assert resolved.config.env.replicas == 3
    assert resolved.source("env.replicas") == "derived" and resolved.source("resources.envs.replicas") == "flag"


BAD = [
    (
        ["--algorithm.advantage", "grpoo"],
        "algorithm.advantage: 'grpoo' is not one of: gae, gigpo, grpo, opo, reinforce_plus_plus, "
        "reinforce_plus_plus_baseline, remax, rloo",
    ),
    (["--algoritm.advantage", "grpo"], "unknown flag --algoritm.advantage; did you mean --algorithm.advantage?"),
    (["--set", "algorithm.advantag=grpo"], "algorithm.advantag: unknown field; did you mean algorithm.advantage?"),
    (["--set", "learner.steps"], "--set 'learner.steps': expected KEY=VALUE, e.g. --set learner.steps=10"),
    (
        ["--learner.steps", "many"],
        "learner.steps: Input should be a valid integer, unable to parse string as an integer",
    ),
    (
        ["--env.options", '{"lenght": 5}'],
        "env.options.lenght: unknown option 'lenght' of env 'corridor'; "
        "known: distance, distances, hint, length, max_turns",
    ),
    (["--rollout.action_parser", "xml"], "rollout.action_parser: 'xml' is not one of: xml_action"),
    (
        ["--set", "reward.components.goal.params={wieght: 2}"],
        "reward.components.goal.params.wieght: unknown param 'wieght' of reward function 'goal'; known: none",
    ),
    (
        ["--env.name", "corridorr"],
        "env.name: 'corridorr' is not one of: agentgym, babyai, corridor, crafting, guess_number, maze, reasoning, "
        "tool_arith, tool_chain, tool_fix, tool_lookup, wordle",
    ),
    (["--set", "run.x=1"], "run: Input should be a valid string"),
    (["--set", "run=a", "--set", "run.x=1"], "--set run.x: run is set to a value, not a section"),
]


@pytest.mark.parametrize("args,line", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_launcher_a_bad_flag_or_value_is_one_line_and_nothing_starts(nothing_starts, capsys, args, line):
    assert launcher.main(["train", *args]) == 2
    assert capsys.readouterr().err == f"config error: {line}\n"


@pytest.mark.parametrize("args,line", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_omrl_submit_a_bad_flag_or_value_is_one_line_and_nothing_is_sent(no_api, tmp_path, capsys, args, line):
    spec = tmp_path / "job.yaml"
    spec.write_text("learner: {steps: 2}\n")
    assert omrl(["--token", "t", "submit", str(spec), *args]) == 2
    assert capsys.readouterr().err == f"omrl: {line}\n"


@pytest.mark.parametrize(
    "text,line",
    [
        ("learner: {steps: -3}\n", "learner.steps: Input should be greater than or equal to 0"),
        ("learner: [1, 2\n", "not valid YAML"),
        ("- a\n- b\n", "expected a mapping of config sections, got list"),
        ("env: {name: corridorr}\n", "env.name: 'corridorr' is not one of: agentgym, babyai, corridor,"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_problem(no_api, nothing_starts, tmp_path, capsys, text, line):
    spec = tmp_path / "job.yaml"
    spec.write_text(text)
    assert omrl(["--token", "t", "submit", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("omrl: ") and line in err
    assert launcher.main(["train", "--config", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and line in err


def test_a_missing_file_is_one_line(no_api, capsys):
    assert omrl(["--token", "t", "submit", "/nonexistent/job.yaml"]) == 2
    assert capsys.readouterr().err == "omrl: /nonexistent/job.yaml: No such file or directory\n"


def test_debug_shows_the_traceback(no_api):
    with pytest.raises(ConfigError):
        omrl(["--debug", "validate", str(ROOT / "docs/job-examples/tiny-local.yaml"), "--learner.steps", "x"])
    with pytest.raises(UsageError):
        launcher.main(["train", "--nope", "--debug"])


def test_config_show_lists_every_field_with_value_and_source(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMRL_CONFIG__ROLLOUT__TOP_K", "5")
    spec = tmp_path / "job.yaml"
    spec.write_text("learner: {steps: 7}\n")
    assert omrl(["config", "show", str(spec), "--algorithm.advantage", "rloo", "--set", "env.max_turns=3"]) == 0
    rows = {line.split()[0]: line.split(None, 2)[1:] for line in capsys.readouterr().out.splitlines()}
    assert rows["learner.steps"] == ["file", "7"] and rows["algorithm.advantage"] == ["flag", "rloo"]
    assert rows["env.max_turns"] == ["flag", "3"] and rows["rollout.top_k"] == ["env", "5"]
    assert rows["algorithm.lr"] == ["default", "0.001"] and rows["resources.learner.cpu"] == ["default", "4"]
    leaves = [d.path for d in walk(JobSpec) if not d.section]
    assert list(rows) == leaves and len(leaves) > 100


def test_config_show_json_and_changed_only(capsys, monkeypatch):
    monkeypatch.delenv("OMRL_CONFIG__ROLLOUT__TOP_K", raising=False)
    assert (
        omrl(["config", "show", "--json", "--changed", "--learner.steps", "3", "--set", "env.options={length: 5}"]) == 0
    )
    shown = json.loads(capsys.readouterr().out)
    assert shown == {
        "env.options": {"value": {"length": 5}, "source": "flag"},
        "learner.steps": {"value": 3, "source": "flag"},
    }


def test_config_explain_a_field(capsys):
    assert omrl(["config", "explain", "algorithm.advantage"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:4] == [
        "algorithm.advantage",
        "  type     str",
        "  default  grpo",
        "  choices  gae, gigpo, grpo, opo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, rloo",
    ]
    assert "OMRL_CONFIG__ALGORITHM__ADVANTAGE=VALUE" in out[4]
    assert (
        "  Registered advantage estimator: grpo, rloo, gae (critic), reinforce_plus_plus(_baseline), gigpo, opo, remax."
        in out
    )


def test_config_explain_bounds_literals_sections_and_plugin_options(capsys):
    assert omrl(["config", "explain", "learner.steps"]) == 0
    assert "  type     int (>= 0, <= 100000000)" in capsys.readouterr().out
    assert omrl(["config", "explain", "algorithm.kl_penalty"]) == 0
    assert "  choices  kl, abs, mse, low_var_kl" in capsys.readouterr().out
    assert omrl(["config", "explain", "env.options"]) == 0
    assert "    corridor      length (int, default 8), distance (int, default 3)" in capsys.readouterr().out
    assert omrl(["config", "explain", "learner"]) == 0
    section = capsys.readouterr().out
    assert "learner.steps" in section and "Policy updates to run." in section


def test_config_explain_an_unknown_field_suggests_the_closest(capsys):
    assert omrl(["config", "explain", "algorithm.advantag"]) == 2
    assert capsys.readouterr().err == "omrl: algorithm.advantag: no such field; did you mean algorithm.advantage?\n"


def test_validate_takes_the_same_flags(capsys):
    spec = str(ROOT / "docs/job-examples/tiny-local.yaml")
    assert omrl(["validate", spec, "--algorithm.advantage", "rloo"]) == 0
    assert capsys.readouterr().out == "ok\n"
    assert omrl(["validate", spec, "--rollout.group_size", "1"]) == 1
    assert capsys.readouterr().err == "omrl: rollout.group_size must be at least 2 for group-based advantages\n"
    assert omrl(["validate", spec, "--rollout.group_sise", "4"]) == 2  # a usage error, not an invalid spec
    assert "did you mean --rollout.group_size?" in capsys.readouterr().err


def test_submit_sends_the_merged_spec(monkeypatch, tmp_path, capsys):
    sent = {}

    def submit(self, spec):
        sent.update(spec)
        return {"id": "job-1", "state": "queued"}

    monkeypatch.setattr(JobsClient, "submit", submit)
    spec = tmp_path / "job.yaml"
    spec.write_text("run: mine\nlearner: {steps: 2}\n")
    assert (
        omrl(["--token", "t", "submit", str(spec), "--algorithm.advantage", "rloo", "--resources.learner.cpu", "2"])
        == 0
    )
    assert capsys.readouterr().out == "job-1\n"
    assert sent["run"] == "mine" and sent["learner"]["steps"] == 2 and sent["algorithm"] == {"advantage": "rloo"}
    assert sent["resources"]["learner"]["cpu"] == "2"


def test_a_failed_run_is_one_line_pointing_at_the_logs(monkeypatch, capsys, tmp_path):
    from services.common import logs
    from services.launcher import local

    def fail(self):
        raise RuntimeError("learner exited with 1:\nTraceback (most recent call last):\n  ...\nValueError: boom")

    monkeypatch.setattr(logs, "setup_logging", lambda *a, **k: "text")
    monkeypatch.setattr(local.LocalRun, "run", fail)
    assert launcher.main(["train", "--plain", "--output_dir", str(tmp_path), "--run", "r"]) == 1
    assert capsys.readouterr().err == (
        f"python -m services.launcher: run failed: learner exited with 1: ValueError: boom (logs in "
        f"{tmp_path}/r/logs; --debug shows the traceback)\n"
    )
    with pytest.raises(RuntimeError):
        launcher.main(["train", "--plain", "--output_dir", str(tmp_path), "--debug"])


SERVICES = ["services.rollout", "services.learner", "services.envs", "services.reward", "services.envs.datasets"]


@pytest.mark.parametrize("module", SERVICES)
@pytest.mark.parametrize("args,line", BAD[:3], ids=[" ".join(a) for a, _ in BAD[:3]])
def test_a_service_entry_point_takes_the_same_flags_and_fails_in_one_line(monkeypatch, capsys, module, args, line):
    """Each service's own command line parses the run config like the launcher: a bad flag or value exits 2
    with one line, before the service imports its heavy parts or binds a port."""
    import importlib
    import sys

    entry = importlib.import_module(module if module.endswith("datasets") else f"{module}.__main__")
    monkeypatch.setattr(sys, "argv", [module, *args])
    with pytest.raises(SystemExit) as info:
        entry.main()
    assert info.value.code == 2
    assert capsys.readouterr().err == f"python -m {module}: config error: {line}\n"


def test_a_service_reads_nested_flags_over_its_config_file(tmp_path):
    from services.common.config_cli import parse_service_args

    path = tmp_path / "run.yaml"
    path.write_text("rollout: {max_new_tokens: 8}\nreward: {timeout_s: 3}\n")
    parser = Parser(prog="t")
    parser.add_argument("--port", type=int, default=1)
    args, config = parse_service_args(
        parser, ["--config", str(path), "--port", "7", "--rollout.max_new_tokens", "32", "--set", "env.max_turns=4"]
    )
    assert (args.port, config.rollout.max_new_tokens, config.reward.timeout_s, config.env.max_turns) == (7, 32, 3, 4)


def test_a_service_imports_its_plugin_modules_before_validating(tmp_path, monkeypatch):
    """`--import MODULE` registers an environment that the config then names (imported before validation)."""
    from services.common.config_cli import parse_service_args

    (tmp_path / "my_env_plugin.py").write_text(
        "from services.envs.builtin.corridor import Corridor\n"
        "from services.envs.registry import register_env\n\n"
        "@register_env('corridor_copy_for_test')\n"
        "class CopyEnv(Corridor):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    parser = Parser(prog="t")
    parser.add_argument("--import", dest="imports", action="append", default=[])
    from services.envs.registry import ENVS

    try:
        _, config = parse_service_args(parser, ["--import", "my_env_plugin", "--env.name", "corridor_copy_for_test"])
    finally:
        ENVS.unregister("corridor_copy_for_test")
    assert config.env.name == "corridor_copy_for_test"


def test_omrl_list_table_is_aligned_and_shows_names_literally():
    from services.cli import render

    jobs = [
        {
            "id": "job-1",
            "state": "running",
            "step": 3,
            "total_steps": 50,
            "created_at": None,
            "name": "a [b] c",
            "metrics": {"reward_mean": 0.5, "success_rate": 0.25},
        },
        {
            "id": "job-22",
            "state": "failed",
            "step": 0,
            "total_steps": 5,
            "created_at": None,
            "name": "x",
            "metrics": None,
        },
    ]
    lines = render.job_table(jobs, color=False).splitlines()
    assert lines[0].split() == ["ID", "STATE", "STEP", "REWARD", "SUCCESS", "AGE", "NAME"]
    assert lines[1].split() == ["job-1", "running", "3/50", "+0.500", "25%", "-", "a", "[b]", "c"]
    assert lines[2].split() == ["job-22", "failed", "0/5", "-", "-", "-", "x"]
    assert (
        len(
            {
                line.index("STATE") if i == 0 else line.index(w)
                for i, (line, w) in enumerate(zip(lines, ["", "running", "failed"]))
            }
        )
        == 1
    ), "the STATE column is aligned"
    assert "\x1b[" not in "\n".join(lines)
    colored = render.job_table(jobs, color=True)
    assert "\x1b[31mfailed" in colored and "a [b] c" in colored
