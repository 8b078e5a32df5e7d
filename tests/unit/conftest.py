"""Fixtures shared by the learner's unit tests."""

import pytest

from tests.support.smoke import build_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama (and its tokenizer) on disk."""
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def tiny64(model_dir):
    """That model in float64, so gradient and logprob comparisons are not blurred by float32 noise."""
    from services.learner.model import load_model

    return load_model(model_dir, "float32").double()
