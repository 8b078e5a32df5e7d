import os
import uuid

import pytest
from hypothesis import settings

import services.plugins  # noqa: F401  (configs parsed here are checked against every plugin registry, as the front ends do)
from tests.support.shared_build import build_once
from tests.support.worker_cores import bind_engines_of_this_worker, share_torch_threads_among_workers

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
bind_engines_of_this_worker()
share_torch_threads_among_workers()
settings.register_profile("loaded_machine", deadline=None)
settings.load_profile("loaded_machine")  # a property test asserts results, not speed: a busy machine misses deadlines

FIRST = ("e2e", "faults", "integration")
"""Folders whose tests run first: the longest tests, so that a parallel run (pytest-xdist, scripts/test.sh:
one module, or one class, per worker at a time) starts them early and its workers finish together."""


LONGEST = (
    "e2e/test_tool_learning.py",
    "e2e/test_learning.py",
    "faults/test_service_restarts.py",
    "integration/test_gigpo_vs_grpo_learning.py",
    "faults/test_redis_restart.py",
    "unit/test_learner_levers.py",  # its compiled-layers test (~80 s) starts early, not in the run's tail
)
"""Modules that start before the rest of their folder: the longest in scripts/test.sh's slowest-50 report (a
hint for the order alone; a module missing here only starts later)."""


def pytest_collection_modifyitems(config, items):
    """The longest modules first, then the first folders' tests, then the rest, each in file order."""

    def rank(item) -> tuple[int, int]:
        parts = item.path.relative_to(config.rootpath).parts
        inside = "/".join(parts[1:])
        folder = FIRST.index(parts[1]) if len(parts) > 2 and parts[1] in FIRST else len(FIRST)
        return (LONGEST.index(inside), 0) if inside in LONGEST else (len(LONGEST), folder)

    items.sort(key=rank)


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
    build = lambda out: prepare_tiny_model(config, out, say=lambda line: None)  # noqa: E731
    return str(build_once(tmp_path_factory, "warm-tiny", build))


@pytest.fixture(scope="session")
def learning_tiny_model(tmp_path_factory) -> str:
    """The tiny model a run on `LEARNING_TASK` (seed 0) builds for itself with the default 150 warm-start steps,
    built once for the session: the whole-system learning runs (tests/e2e/test_learning.py) and the in-process
    GiGPO-against-GRPO run (tests/integration/test_gigpo_vs_grpo_learning.py) start from it."""
    from services.common.config import load_config
    from services.launcher.tiny import prepare_tiny_model
    from tests.support.learner import LEARNING_TASK

    config = load_config(None, LEARNING_TASK)
    build = lambda out: prepare_tiny_model(config, out, say=lambda line: None)  # noqa: E731
    return str(build_once(tmp_path_factory, "learning-tiny", build))
