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
