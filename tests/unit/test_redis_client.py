"""redis_client takes the Redis password from $REDIS_PASSWORD, so it never has to be on a command line.
No connection is made: the client's connection settings are inspected."""

from services.common.run_state import RECONNECT_TRIES, redis_client


def connection_kwargs(url: str) -> dict:
    return redis_client(url).connection_pool.connection_kwargs


def test_a_url_without_password_takes_it_from_the_environment(monkeypatch):
    monkeypatch.setenv("REDIS_PASSWORD", "from-env")
    kwargs = connection_kwargs("redis://cache.internal:6380/2")
    assert kwargs["password"] == "from-env"
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("cache.internal", 6380, 2)


def test_a_url_with_a_password_keeps_its_own(monkeypatch):
    monkeypatch.setenv("REDIS_PASSWORD", "from-env")
    assert connection_kwargs("redis://:in-url@cache.internal:6379/0")["password"] == "in-url"
    assert connection_kwargs("redis://user:in-url@cache.internal:6379/0")["username"] == "user"


def test_a_user_without_password_in_the_url_takes_the_environments(monkeypatch):
    monkeypatch.setenv("REDIS_PASSWORD", "from-env")
    kwargs = connection_kwargs("rediss://user@cache.internal:6380/0")
    assert (kwargs["username"], kwargs["password"]) == ("user", "from-env")


def test_no_password_anywhere_means_none(monkeypatch):
    monkeypatch.delenv("REDIS_PASSWORD", raising=False)
    assert connection_kwargs("redis://127.0.0.1:6379/0").get("password") is None
    monkeypatch.setenv("REDIS_PASSWORD", "")
    assert connection_kwargs("redis://127.0.0.1:6379/0").get("password") is None


def test_retries_default_to_riding_out_a_restart_and_can_be_turned_off():
    assert redis_client("redis://127.0.0.1:6379/0").get_retry().get_retries() == RECONNECT_TRIES
    assert redis_client("redis://127.0.0.1:6379/0", retries=0).get_retry().get_retries() == 0
