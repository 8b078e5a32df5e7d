"""Which rollout servers the learner pushes again while it waits for a step (`_catch_up_servers`): those its registry
shows behind, except one its own push brought to the current version whose registry entry is still the heartbeat
from before that push (a push costs the server a pause of its requests, and a large model seconds of the step)."""

from types import SimpleNamespace

from services.common.config import TrainConfig
from services.learner.service import LearnerService
from services.weightsync.base import PushResult


class Registry:
    def __init__(self):
        self.servers = {"a:1": {"policy_version": 0, "ts": 100.0}, "b:1": {"policy_version": 0, "ts": 100.5}}
        self.published = []

    def rollout_servers(self):
        return {address: dict(info) for address, info in self.servers.items()}

    def publish_version(self, version):
        self.published.append(version)

    def beat(self, address, version, ts):
        self.servers[address] = {"policy_version": version, "ts": ts}


class Pusher:
    needs_servers = True

    def __init__(self, fail=()):
        self.calls, self.fail = [], set(fail)

    def push(self, version, weights, addresses, rollback=False, run=""):
        self.calls.append((version, list(addresses)))
        return [
            PushResult(a, a not in self.fail, version, "sum", 0.01, "" if a not in self.fail else "down")
            for a in addresses
        ]


def learner(pusher):
    trainer = SimpleNamespace(weight_set_for_push=lambda: SimpleNamespace(checksum="sum"))
    service = LearnerService(TrainConfig(), trainer=trainer, pusher=pusher, state=Registry(), stream=None)
    service.step = service.version = 1
    return service


def test_a_server_our_push_updated_is_not_pushed_again_on_its_heartbeat_from_before():
    pusher = Pusher()
    service = learner(pusher)
    service._push()
    service._catch_up_servers()  # the registry still says v0 for both: heartbeats from before the push
    assert pusher.calls == [(1, ["a:1", "b:1"])]


def test_a_server_that_beats_again_with_an_older_version_is_caught_up():
    pusher = Pusher()
    service = learner(pusher)
    service._push()
    service.state.beat("a:1", 0, 105.0)  # a heartbeat after the push, still v0: it restarted and lost v1
    service.state.beat("b:1", 1, 105.2)
    service._catch_up_servers()
    assert pusher.calls == [(1, ["a:1", "b:1"]), (1, ["a:1"])]


def test_a_server_whose_push_failed_is_caught_up_at_once():
    pusher = Pusher(fail={"b:1"})
    service = learner(pusher)
    service._push()
    service._catch_up_servers()
    assert pusher.calls == [(1, ["a:1", "b:1"]), (1, ["b:1"])]


def test_what_a_server_applied_counts_for_that_version_only():
    pusher = Pusher()
    service = learner(pusher)
    service._push()  # v1 applied on both
    pusher.fail = {"a:1"}
    service.step = service.version = 2
    service._push()  # v2 failed on a:1, whose registry entry is still the heartbeat from before the v1 push
    service._catch_up_servers()
    assert pusher.calls == [(1, ["a:1", "b:1"]), (2, ["a:1", "b:1"]), (2, ["a:1"])]
