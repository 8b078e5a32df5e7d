"""The AgentGym adapter's server logic without a server: answers that are not retried as outages, restarts told
by ids, and the first reset of a task played by one episode at a time."""

import threading
import time

import httpx
import pytest

from services.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from services.envs.agentgym.servers import Server
from services.envs.agentgym.tasks import TaskGate
from services.envs.base import TaskRejected


def server_answering(status: int, body: bytes, content_type: str = "application/json") -> Server:
    transport = httpx.MockTransport(
        lambda request: httpx.Response(status, content=body, headers={"content-type": content_type})
    )
    return Server("http://fake:1", httpx.Client(base_url="http://fake:1", transport=transport, timeout=1.0), "babyai")


@pytest.mark.parametrize(
    "status, body, said",
    [
        (501, b"Not Implemented", "HTTP 501"),
        (200, b"<html>hello</html>", "reply is not JSON"),
        (404, b"{}", "HTTP 404"),
    ],
)
def test_answers_no_retry_can_fix_are_invalid_argument_not_outages(status, body, said):
    with pytest.raises(InvalidArgument, match=said):
        server_answering(status, body).call("POST", "/create", "create")


def test_an_id_handed_out_again_is_a_restart_and_ids_of_concurrent_creates_in_any_order_are_not():
    server = server_answering(200, b"{}")
    first, second = server.before_create(), server.before_create()  # two creates sent at once
    assert server.note_created(1, second) == 0 and server.note_created(0, first) == 0  # answered out of order
    later = server.before_create()
    assert server.note_created(0, later) == 1, "id 0 again, for a create sent after id 1 came back"
    assert server.epoch == 1 and server.max_id == 0
    with pytest.raises(Unavailable, match="restarted after this episode's environment was created"):
        server.check_epoch(0, "step env 0")
    server.check_epoch(1, "step env 0")


def test_a_create_that_overlapped_a_restart_keeps_the_old_epoch():
    server = server_answering(200, b"{}")
    before = server.before_create()
    server.refused("connection refused")
    assert server.epoch == 1 and server.note_created(5, before) == 0


def test_a_task_not_proven_is_reset_by_one_episode_at_a_time_and_a_hang_is_remembered():
    gate, order = TaskGate(), []
    hung = TaskRejected("reset of task 7 never answered", "hung")

    def first():
        with gate.first_reset(7, 5.0):
            order.append("trial")
            time.sleep(0.3)
            gate.reject(7, hung)

    def second():
        try:
            with gate.first_reset(7, 5.0):
                order.append("sent")
        except TaskRejected as exc:
            order.append(exc.reason)

    threads = [threading.Thread(target=first)]
    threads[0].start()
    time.sleep(0.05)
    threads += [threading.Thread(target=second) for _ in range(3)]
    for thread in threads[1:]:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert order == ["trial", "hung", "hung", "hung"]
    with pytest.raises(TaskRejected, match="not sent again"), gate.first_reset(7, 1.0):
        pass


def test_once_a_task_answered_its_resets_run_at_once_and_a_waiter_gives_up_at_its_deadline():
    gate = TaskGate()
    with gate.first_reset(3, 1.0):
        gate.proved(3)
    with gate.first_reset(3, 1.0), gate.first_reset(3, 1.0):  # proven: no waiting
        pass
    with gate.first_reset(4, 1.0):
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="first reset, still under way"), gate.first_reset(4, 0.2):
            pass
        assert time.monotonic() - start < 1.0
    assert gate.proven_task() == 3


def test_a_quarantined_task_is_drawn_again_among_the_others_the_same_way_every_time():
    from services.envs.datasets import NoTaskLeft, TaskSplit

    split = TaskSplit("train", list(range(10)))
    keys = [f"0:{claim}" for claim in range(50)]
    drawn = [split.draw(key) for key in keys]
    banned = {drawn[0], drawn[1]}
    again = [split.draw(key, banned) for key in keys]
    assert not banned & set(again)
    assert [a for a, d in zip(again, drawn) if d not in banned] == [d for d in drawn if d not in banned]
    assert again == [split.draw(key, banned) for key in keys]
    with pytest.raises(NoTaskLeft, match="every train task is quarantined"):
        split.draw("0:0", set(range(10)))
