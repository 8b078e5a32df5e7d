import os
import uuid

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def redis_url() -> str:
    import redis

    url = os.environ.get("OMRL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        redis.Redis.from_url(url, socket_timeout=2).ping()
    except redis.ConnectionError as exc:
        pytest.fail(f"tests need Redis at {url} (scripts/setup.sh starts one): {exc}")
    return url


@pytest.fixture
def run_name() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


WARM_TINY_MODEL_STEPS = 20


@pytest.fixture(scope="session")
def warm_tiny_model(tmp_path_factory) -> str:
    """The tiny model a local run on corridor (default options, seed 0) builds for itself with
    `model.warmstart_steps=20`, built once for the session: pass `model.path=` this. The model depends on
    the env's name and options, the seed and the warm-start steps only (not on data_dir, train_tasks or
    replicas), so every such run got this same model; each build took 20-45 s of a CI run (minutes on a
    loaded machine). Runs that test the build itself (the launcher's model stage) leave model.path unset."""
    from services.common.config import load_config
    from services.launcher.tiny import prepare_tiny_model

    config = load_config(None, [f"model.warmstart_steps={WARM_TINY_MODEL_STEPS}"])
    return str(prepare_tiny_model(config, tmp_path_factory.mktemp("warm-tiny"), say=lambda line: None))
