"""`model.max_model_len` against the positions the model has, before anything is built: the tiny model's
are known from its shape (the config's own validation checks them); a local model directory's are read from
its config.json when the launcher starts. A Hugging Face id that is not a local directory is left to the
services that download it (no network here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.common.config import ModelConfig
from services.common.config_layers import ConfigError

POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
"""Where model configs keep their number of positions (Llama and most others, GPT-2, the rest)."""


def local_positions(path: str) -> tuple[int, str] | None:
    """(positions, the config key that holds them) of the model in the local directory `path`; None for a
    path that is no local directory (a hub id), a config that cannot be read or names no positions, and one
    whose rope scaling stretches them (vLLM works that length out itself)."""
    if not Path(path).is_dir():
        return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError):  # the rollout and learner report a model they cannot load
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if _rope_scaled(getattr(text, "rope_scaling", None)):
        return None
    for key in POSITION_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value, key
    return None


def _rope_scaled(params: Any) -> bool:
    """True where rope parameters (one set, or one per layer type) scale the positions by a factor."""
    if not isinstance(params, dict):
        return False
    sets = [params, *(v for v in params.values() if isinstance(v, dict))]
    return any(s.get("rope_type", s.get("type")) not in (None, "default") and s.get("factor") for s in sets)


def check_local_model(model: ModelConfig) -> None:
    """Raises ConfigError naming `model.max_model_len` where it is more than the positions of the local model
    at `model.path`; nothing for the tiny model (checked with the config) or a hub id."""
    if not model.path:
        return
    found = local_positions(model.path)
    if found is not None and model.max_model_len > found[0]:
        positions, key = found
        raise ConfigError(
            [
                f"model.max_model_len: {model.max_model_len} is more than the {positions} positions of the model "
                f"at {model.path} ({key} of its config); set it to {positions} or less"
            ]
        )
