"""The job spec is the run config (TrainConfig) plus resources and schedule: same models, same errors."""

import json
from pathlib import Path
from typing import get_args

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from services.common.config import MAX_FREE_FORM_BYTES, MAX_FREE_FORM_DEPTH, TrainConfig, dump_config, load_config
from services.jobs.spec import JobSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "job-examples"


def locs(exc: ValidationError) -> list[tuple]:
    return [e["loc"] for e in exc.errors()]


def test_every_run_config_file_is_a_job_spec(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(dump_config(load_config(None, ["learner.steps=7", "env.name=guess_number"])))
    spec = load_config(str(path), schema=JobSpec)
    assert isinstance(spec, JobSpec) and spec.learner.steps == 7 and spec.resources.learner.gpus == 0


def test_the_services_get_a_run_config_without_the_job_sections():
    spec = load_config(str(EXAMPLES / "gpu-cluster.yaml"), schema=JobSpec)
    config = spec.train_config()
    assert type(config) is TrainConfig and "resources" not in yaml.safe_load(dump_config(config))
    assert config.learner.nproc == 4


@pytest.mark.parametrize(
    "data,loc",
    [
        ({"resources": {"learner": {"gpus": -1}}}, ("resources", "learner", "gpus")),
        ({"resources": {"rollout": {"memory": "lots"}}}, ("resources", "rollout", "memory")),
        ({"resources": {"envs": {"replicas": 0}}}, ("resources", "envs", "replicas")),
        ({"schedule": {"max_runtime_s": 5}}, ("schedule", "max_runtime_s")),
        ({"schedule": {"tolerations": [{"effect": "Sometimes"}]}}, ("schedule", "tolerations", 0, "effect")),
        ({"schedule": {"priority": 3}}, ("schedule", "priority")),
        ({"learner": {"steps": -1}}, ("learner", "steps")),
        ({"learner": {"nproc": 5000}}, ("learner", "nproc")),
        ({"algorithm": {"kl_coef": 1e300}}, ("algorithm", "kl_coef")),
        ({"seed": -1}, ("seed",)),
    ],
)
def test_bad_fields_are_named(data, loc):
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(data)
    assert loc in locs(info.value)


def test_learner_gpus_must_match_its_processes():
    with pytest.raises(ValidationError, match=r"resources.learner.gpus \(4\) must equal learner.nproc \(1\)"):
        JobSpec.model_validate({"resources": {"learner": {"gpus": 4}}})
    assert JobSpec.model_validate({"resources": {"learner": {"gpus": 4}}, "learner": {"nproc": 4}})


def test_rollout_gpus_are_its_tensor_parallel_size():
    spec = JobSpec.model_validate({"resources": {"rollout": {"gpus": 2}}})
    assert spec.rollout.gpus == 2 and spec.train_config().rollout.gpus == 2
    with pytest.raises(ValidationError, match=r"resources.rollout.gpus \(2\) and rollout.gpus \(4\) disagree"):
        JobSpec.model_validate({"resources": {"rollout": {"gpus": 2}}, "rollout": {"gpus": 4}})
    with pytest.raises(ValidationError, match=r"rollout.gpus \(2\) needs resources.rollout.gpus = 2"):
        JobSpec.model_validate({"rollout": {"gpus": 2}})


def test_quantities_take_kubernetes_units():
    spec = JobSpec.model_validate({"resources": {"reward": {"cpu": "500m", "memory": "1.5Gi"}}})
    assert (spec.resources.reward.cpu, spec.resources.reward.memory) == ("500m", "1.5Gi")


def test_env_service_replicas_are_one_number_set_in_either_place():
    assert JobSpec.model_validate({"resources": {"envs": {"replicas": 3}}}).env.replicas == 3
    assert JobSpec.model_validate({"env": {"replicas": 2}}).resources.envs.replicas == 2
    with pytest.raises(ValidationError, match=r"resources.envs.replicas \(3\) and env.replicas \(2\) disagree"):
        JobSpec.model_validate({"env": {"replicas": 2}, "resources": {"envs": {"replicas": 3}}})
    with pytest.raises(ValidationError, match="resources.envs.replicas: Input should be less than or equal to 64"):
        JobSpec.model_validate({"resources": {"envs": {"replicas": 300}}})


def numeric_fields(model, prefix=()):
    """(loc, field) of every int/float field, through nested sections, dicts and lists of sections."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        inner = [a for a in (annotation, *get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if inner:
            yield from numeric_fields(inner[0], (*prefix, name))
        elif annotation in (int, float, int | None, float | None):
            yield (*prefix, name), field


def test_every_numeric_field_has_both_bounds():
    unbounded, fields = [], list(numeric_fields(JobSpec))
    assert {("algorithm", "kl_coef"), ("reward", "components", "weight"), ("seed",)} <= {loc for loc, _ in fields}
    for loc, field in fields:
        kinds = {type(m).__name__ for m in field.metadata}
        if not ({"Ge", "Gt"} & kinds and {"Le", "Lt"} & kinds):
            unbounded.append(".".join(loc))
    assert unbounded == []


@pytest.mark.parametrize(
    "json_body,loc",
    [
        ('{"algorithm": {"kl_coef": Infinity}}', ("algorithm", "kl_coef")),
        ('{"rollout": {"temperature": NaN}}', ("rollout", "temperature")),
        ('{"reward": {"components": {"goal": {"weight": -Infinity}}}}', ("reward", "components", "goal", "weight")),
        ('{"env": {"options": {"length": [1, NaN]}}}', ("env", "options")),
        (
            '{"reward": {"components": {"goal": {"params": {"x": {"y": Infinity}}}}}}',
            ("reward", "components", "goal", "params"),
        ),
    ],
)
def test_non_finite_numbers_are_rejected_anywhere(json_body, loc):
    for data in (json.loads(json_body), json_body):
        with pytest.raises(ValidationError) as info:
            JobSpec.model_validate_json(data) if isinstance(data, str) else JobSpec.model_validate(data)
        assert loc in locs(info.value)


def test_weight_staging_in_memory_needs_a_one_worker_engine():
    """The arena lives in the engine's one worker: a tensor-parallel engine's other workers could not read it."""
    assert TrainConfig.model_validate({"rollout": {"weight_staging": "memory"}}).rollout.weight_staging == "memory"
    with pytest.raises(ValidationError, match="weight_staging 'memory' .* set rollout.gpus: 1"):
        TrainConfig.model_validate({"rollout": {"weight_staging": "memory", "gpus": 2}})
    with pytest.raises(ValidationError, match="weight_staging 'memory'"):
        JobSpec.model_validate(
            {"resources": {"rollout": {"gpus": 2}}, "rollout": {"weight_staging": "memory"}}
        ).train_config()


def nested(depth: int) -> dict:
    """`depth` dicts, each inside the one before."""
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    "where",
    [
        lambda v: {"env": {"name": "reasoning", "options": {"config": v}}},
        lambda v: {"rollout": {"engine_args": {"hf_overrides": v}}},
        lambda v: {"reward": {"components": {"goal": {"params": {"x": v}}}}},
    ],
    ids=["env.options", "rollout.engine_args.hf_overrides", "reward.params"],
)
@pytest.mark.parametrize("depth", [MAX_FREE_FORM_DEPTH, 300, 5000])
def test_free_form_nesting_is_bounded(where, depth):
    """One level is the free-form dict itself: up to MAX_FREE_FORM_DEPTH nested levels pass this check, deeper ones
    are a validation error (never a RecursionError), however deep."""
    data = where(nested(depth - 1))  # with the free-form dict itself, `depth` levels
    if depth <= MAX_FREE_FORM_DEPTH:
        try:
            JobSpec.model_validate(data)
        except ValidationError as exc:  # the plugin's own schema may refuse the key: not the depth check
            assert "nested deeper" not in str(exc)
        return
    with pytest.raises(ValidationError, match=f"nested deeper than {MAX_FREE_FORM_DEPTH} levels"):
        JobSpec.model_validate(data)


def test_free_form_lists_count_as_levels_and_the_limit_is_exact():
    ok = {"cudagraph_capture_sizes": [nested(MAX_FREE_FORM_DEPTH - 2)]}  # engine_args, the list, then the dicts
    assert TrainConfig.model_validate({"rollout": {"engine_args": ok}}).rollout.engine_args == ok
    too_deep = {"cudagraph_capture_sizes": [nested(MAX_FREE_FORM_DEPTH - 1)]}
    with pytest.raises(ValidationError, match=r"cudagraph_capture_sizes\[0\](\.a)+\.\.\. is nested deeper"):
        TrainConfig.model_validate({"rollout": {"engine_args": too_deep}})


def test_the_deepest_accepted_spec_round_trips_through_json():
    """What the job store does with a spec: what validation lets through must serialise and load back."""
    spec = JobSpec.model_validate({"rollout": {"engine_args": {"hf_overrides": nested(MAX_FREE_FORM_DEPTH - 1)}}})
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec


def test_free_form_size_is_bounded():
    small = {"hf_overrides": {"x": "a" * (MAX_FREE_FORM_BYTES - 100)}}
    assert TrainConfig.model_validate({"rollout": {"engine_args": small}})
    with pytest.raises(ValidationError, match=f"bytes as JSON; free-form options take at most {MAX_FREE_FORM_BYTES}"):
        TrainConfig.model_validate({"rollout": {"engine_args": {"hf_overrides": {"x": "a" * MAX_FREE_FORM_BYTES}}}})
    many = {str(i): i for i in range(20_000)}  # small values, many keys
    with pytest.raises(ValidationError, match="bytes as JSON"):
        TrainConfig.model_validate({"env": {"name": "reasoning", "options": {"config": many}}})
