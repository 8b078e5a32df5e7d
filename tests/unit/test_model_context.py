"""`model.max_model_len` longer than the model's positions fails before anything is built, in one line naming
the field: for the tiny model when the config is validated, for a local model directory when the launcher
starts (its config.json); a Hugging Face id is not looked up."""

import pytest
from pydantic import ValidationError

from services.common.config import TINY_POSITIONS, ModelConfig, TrainConfig
from services.common.config_layers import ConfigError
from services.common.model_context import check_local_model
from services.launcher import __main__ as launcher
from services.launcher import local


@pytest.fixture
def nothing_starts(monkeypatch):
    def refuse(self, *args, **kwargs):
        raise AssertionError("the launcher started a run")

    monkeypatch.setattr(local.LocalRun, "run", refuse)


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    """A local model directory whose config.json has 256 positions."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("short-model")
    LlamaConfig(max_position_embeddings=256, hidden_size=64, num_attention_heads=2).save_pretrained(folder)
    return folder


def test_the_tiny_model_s_positions_bound_the_context_at_validation():
    with pytest.raises(ValidationError, match=f"{TINY_POSITIONS + 1} is more than the {TINY_POSITIONS} positions"):
        TrainConfig.model_validate({"model": {"max_model_len": TINY_POSITIONS + 1}})
    assert TrainConfig.model_validate({"model": {"max_model_len": TINY_POSITIONS}}).model.max_model_len == 1024
    assert ModelConfig(path="Qwen/Qwen2.5-0.5B-Instruct", max_model_len=8192).max_model_len == 8192


def test_the_launcher_says_so_in_one_line(nothing_starts, capsys):
    assert launcher.main(["train", "--model.max_model_len", "2048"]) == 2
    assert capsys.readouterr().err == (
        "config error: model.max_model_len: 2048 is more than the 1024 positions of the tiny model (built when "
        "model.path is empty); set it to 1024 or less, or set model.path\n"
    )


def test_a_local_model_s_positions_bound_the_context_when_the_launcher_starts(nothing_starts, capsys, short_model):
    assert launcher.main(["train", "--model", str(short_model), "--model.max_model_len", "512"]) == 2
    assert capsys.readouterr().err == (
        f"config error: model.max_model_len: 512 is more than the 256 positions of the model at {short_model} "
        "(max_position_embeddings of its config); set it to 256 or less\n"
    )
    check_local_model(ModelConfig(path=str(short_model), max_model_len=256))


def test_a_hub_id_or_a_scaled_rope_is_not_checked(tmp_path):
    check_local_model(ModelConfig(path="nobody/no-such-model-here", max_model_len=131072))  # no network, no error
    from transformers import LlamaConfig

    rope = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    LlamaConfig(max_position_embeddings=256, rope_parameters=rope).save_pretrained(tmp_path)
    check_local_model(ModelConfig(path=str(tmp_path), max_model_len=1024))
    with pytest.raises(ConfigError):
        LlamaConfig(max_position_embeddings=256).save_pretrained(tmp_path)
        check_local_model(ModelConfig(path=str(tmp_path), max_model_len=1024))
