"""The check of AgentGym servers before a run starts (services.envs.agentgym.preflight), against a fake
server of the TextCraft shape (a real process) and canned HTTP servers (threads) for answers no AgentGym
server gives: every failure is one line naming the server, the route and what it answered."""

import contextlib
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from services.common.grpc_server import free_port
from services.envs.agentgym.preflight import check_servers
from services.envs.base import InvalidTask
from tests.support.agentgym_process import FakeServer


@pytest.fixture(scope="module")
def textcraft(tmp_path_factory):
    server = FakeServer("textcraft", tmp_path_factory.mktemp("preflight"))
    yield server
    server.kill()


@contextlib.contextmanager
def canned(replies: dict[str, tuple[int, str]]) -> Iterator[tuple[str, list[str]]]:
    """An HTTP server answering `replies` (path -> status, body), 404 elsewhere; yields its URL and the
    requests it got ("POST /create")."""
    requests: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.answer()

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.answer()

        def answer(self):
            requests.append(f"{self.command} {self.path}")
            status, body = replies.get(self.path, (404, '{"detail":"Not Found"}'))
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def failure(family: str, urls: list[str]) -> str:
    with pytest.raises(InvalidTask) as err:
        check_servers(family, urls, timeout_s=8.0)
    line = str(err.value)
    assert "\n" not in line
    return line


def test_a_live_server_of_the_family_passes_and_leaves_no_environment_open(textcraft):
    live = lambda: httpx.get(textcraft.url + "/__live", timeout=5).json()  # noqa: E731
    closes = lambda: httpx.get(textcraft.url + "/__stats", timeout=5).json()["closes"]  # noqa: E731
    before, closed_before = live(), closes()
    assert check_servers("textcraft", [textcraft.url], timeout_s=8.0) == f"env servers: {textcraft.url} (textcraft) ok"
    assert live() == before and closes() == closed_before + 1


def test_a_closed_port_fails_fast_naming_the_server():
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    line = failure("textcraft", [url])
    assert time.monotonic() - start < 5
    assert line.startswith(f"AgentGym textcraft server {url}: GET /: ConnectError: "), line


def test_the_server_that_is_down_is_named_among_several(textcraft):
    down = f"http://127.0.0.1:{free_port()}"
    assert failure("textcraft", [textcraft.url, down]).startswith(f"AgentGym textcraft server {down}: GET /: ")


def test_a_server_of_another_family_fails_naming_it(textcraft):
    assert failure("maze", [textcraft.url]) == (
        f"AgentGym maze server {textcraft.url}: POST /maze/create answered HTTP 404 "
        """'{"detail":"Not Found"}' (not a maze server: wrong family; not retryable)"""
    )
    # WebShop's create answers a bare id; TextCraft's an object
    line = failure("webshop", [textcraft.url])
    assert line.startswith(f'AgentGym webshop server {textcraft.url}: POST /create answered HTTP 200 \'{{"id":')
    assert line.endswith("(not a bare integer id: not a webshop server: wrong family; not retryable)")


def test_http_501_fails_as_not_retryable():
    with canned({"/": (200, '"hello"'), "/create": (501, "Not Implemented")}) as (url, _):
        assert failure("textcraft", [url]) == (
            f"AgentGym textcraft server {url}: POST /create answered HTTP 501 'Not Implemented' "
            "(not implemented; not retryable)"
        )


def test_a_reply_that_is_not_json_fails_as_not_retryable():
    page = "<html><body>" + "x" * 200 + "</body></html>"
    with canned({"/": (200, "hello"), "/create": (200, page)}) as (url, _):
        line = failure("babyai", [url])
    assert line == (
        f"AgentGym babyai server {url}: POST /create answered HTTP 200 {(page[:120] + '...')!r} "
        "(not JSON; not retryable)"
    )


def test_a_bare_id_passes_for_webshop_which_has_no_close():
    with canned({"/": (200, '"hello"'), "/create": (200, "7")}) as (url, requests):
        assert check_servers("webshop", [url], timeout_s=8.0) == f"env servers: {url} (webshop) ok"
    assert requests == ["GET /", "POST /create"]


def test_a_missing_close_says_nothing_and_a_refused_one_is_sent_again_after_a_reset():
    with canned({"/": (200, '"hello"'), "/create": (200, '{"id": 3}')}) as (url, requests):
        check_servers("babyai", [url], timeout_s=8.0)
    assert requests == ["GET /", "POST /create", "POST /close"]
    # BabyAI keeps an environment that was never reset: its close answers false
    replies = {"/": (200, '"hello"'), "/create": (200, '{"id": 3}'), "/close": (200, "false")}
    with canned({**replies, "/reset": (200, '{"observation": "a room"}')}) as (url, requests):
        check_servers("babyai", [url], timeout_s=8.0)
    assert requests == ["GET /", "POST /create", "POST /close", "POST /reset", "POST /close"]
