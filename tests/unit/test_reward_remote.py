"""The `remote` component against real in-process reward gRPC servers: each trajectory gets the sum of the servers'
totals, one Score call per server for a batch; a server that is down or does not answer fails the batch within
the deadline, the composer naming the component and the message the server and its address."""

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from services.common.config import RewardConfig
from services.common.grpc_server import free_port
from services.common.protos import reward_pb2_grpc
from services.common.registry import Registry
from services.jobs.spec import JobSpec
from services.jobs.spec_policy import SpecNotAllowed, SpecPolicy
from services.reward.base import RewardFunction
from services.reward.composer import RewardComposer
from services.reward.server import RewardServicer
from services.reward.service import RewardService
from tests.support.envs_grpc import running
from tests.support.service_fakes import trajectory

BATCH = [trajectory((n, n % 2 == 0), success=n > 2, trajectory_id=f"t{n}") for n in range(1, 6)]
SLOW_S = 1.0


class Slow(RewardFunction):
    name = "slow"

    def __call__(self, traj) -> float:
        time.sleep(SLOW_S)
        return 1.0


SLOW = Registry("reward function")
SLOW.register("slow")(Slow)


class CountingServicer(RewardServicer):
    def __init__(self, service):
        super().__init__(service)
        self.calls: list[int] = []

    async def Score(self, request, context):
        self.calls.append(len(request.trajectories))
        return await super().Score(request, context)


def server(components: dict, registry=None) -> tuple[RewardComposer, CountingServicer]:
    composer = RewardComposer(components, **({"registry": registry} if registry else {}))
    servicer = CountingServicer(RewardService(composer, timeout_s=10, metrics_registry=CollectorRegistry()))
    return composer, servicer


def serving(servicer):
    return lambda grpc_server: reward_pb2_grpc.add_RewardServiceServicer_to_server(servicer, grpc_server)


def remote(servers: dict, timeout_s: float = 5.0, weight: float = 1.0) -> RewardComposer:
    return RewardComposer({"remote": {"weight": weight, "params": {"servers": servers, "timeout_s": timeout_s}}})


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_each_trajectory_gets_the_sum_of_the_servers_totals_in_one_call_per_server():
    rm, rm_servicer = server({"goal": {"weight": 1.0}, "length_penalty": {"weight": 0.5, "params": {"max_tokens": 4}}})
    judge, judge_servicer = server({"format": {"weight": 2.0}})

    async def main():
        async with running(serving(rm_servicer)) as rm_address, running(serving(judge_servicer)) as judge_address:
            composer = remote({"rm": rm_address, "judge": judge_address}, weight=3.0)
            try:
                return await asyncio.to_thread(composer.score_many, BATCH)
            finally:
                composer.components[0][2].close()

    scores = run(main())
    expected = [3.0 * (a.total + b.total) for a, b in zip(rm.score_many(BATCH), judge.score_many(BATCH))]
    assert [s.total for s in scores] == pytest.approx(expected)
    assert [list(s.components) for s in scores] == [["remote"]] * len(BATCH)
    assert len(set(expected)) > 2  # the trajectories' own scores, in order, not one value for all
    assert rm_servicer.calls == judge_servicer.calls == [len(BATCH)]


def test_two_servers_as_two_components_get_their_own_weights_and_breakdown_entries():
    rm, rm_servicer = server({"goal": {"weight": 1.0}, "length_penalty": {"weight": 0.5, "params": {"max_tokens": 4}}})
    judge, judge_servicer = server({"format": {"weight": 2.0}})

    async def main():
        async with running(serving(rm_servicer)) as rm_address, running(serving(judge_servicer)) as judge_address:
            composer = RewardComposer(
                {
                    "rm": {"type": "remote", "weight": 3.0, "params": {"servers": {"rm": rm_address}}},
                    "judge": {"type": "remote", "weight": 0.5, "params": {"servers": {"judge": judge_address}}},
                }
            )
            try:
                return await asyncio.to_thread(composer.score_many, BATCH)
            finally:
                for _, _, fn in composer.components:
                    fn.close()

    scores = run(main())
    for scored, a, b in zip(scores, rm.score_many(BATCH), judge.score_many(BATCH)):
        assert scored.components == pytest.approx({"rm": 3.0 * a.total, "judge": 0.5 * b.total})
        assert scored.total == pytest.approx(3.0 * a.total + 0.5 * b.total)
    assert rm_servicer.calls == judge_servicer.calls == [len(BATCH)]


def test_per_turn_passes_the_servers_turn_rewards_through_and_their_outcome_on_the_last_turn():
    hints = {"go left": "left"}
    prm, prm_servicer = server({"goal": {"weight": 2.0}, "hinted_action": {"weight": 0.5, "params": {"hints": hints}}})
    batch = [
        trajectory((2, True), (3, True), success=True, trajectory_id="a"),
        trajectory((1, False), trajectory_id="b"),
    ]
    for traj in batch:
        traj.turns[0].anchor = "cell 3: go left"

    async def main():
        async with running(serving(prm_servicer)) as address:
            composer = RewardComposer(
                {"remote": {"weight": 3.0, "params": {"servers": {"prm": address}, "per_turn": True}}}
            )
            try:
                return await asyncio.to_thread(composer.score_many, batch)
            finally:
                composer.components[0][2].close()

    scores = run(main())
    assert [s.turns for s in scores] == [[3.0 * 0.5, 3.0 * 2.0], [0.0]]  # turn 1 hinted; goal on the last turn
    assert [s.total for s in scores] == pytest.approx([3.0 * 2.5, 0.0])


def test_a_server_that_is_down_fails_the_batch_at_once_naming_component_server_and_address():
    _, up = server({"goal": {"weight": 1.0}})

    async def main():
        async with running(serving(up)) as address:
            down = f"127.0.0.1:{free_port()}"
            composer = remote({"rm": address, "judge": down}, timeout_s=20)
            start = time.monotonic()
            try:
                with pytest.raises(RuntimeError) as info:
                    await asyncio.to_thread(composer.score_many, BATCH[:2])
            finally:
                composer.components[0][2].close()
            return str(info.value), time.monotonic() - start, down

    message, elapsed_s, down = run(main())
    assert "reward component 'remote' failed on 2 trajectories" in message
    assert f"reward server 'judge' at {down}: Unavailable" in message and "'rm'" not in message
    assert elapsed_s < 10  # refused at once, not after the 20 s deadline


def test_a_server_that_does_not_answer_fails_the_batch_after_the_deadline():
    _, slow = server({"slow": {"weight": 1.0}}, registry=SLOW)

    async def main():
        async with running(serving(slow)) as address:
            composer = remote({"prm": address}, timeout_s=0.2)
            start = time.monotonic()
            try:
                with pytest.raises(RuntimeError) as info:
                    await asyncio.to_thread(composer.score_many, BATCH[:1])
            finally:
                composer.components[0][2].close()
            return str(info.value), time.monotonic() - start, address

    message, elapsed_s, address = run(main())
    assert f"reward server 'prm' at {address}: DeadlineExceeded" in message
    assert elapsed_s < SLOW_S  # the deadline, not the server, ended the call


@pytest.mark.parametrize(
    "params, at, detail",
    [
        ({"servers": {}}, "servers", "servers"),
        ({"servers": {"rm": "reward-rm"}}, "servers.rm", "host:port"),
        ({"servers": {"rm": "reward rm:50053"}}, "servers.rm", "host:port"),
        ({"servers": {"rm": "reward-rm:50053"}, "timeout_s": 0}, "timeout_s", "timeout_s"),
        ({"address": "reward-rm:50053"}, "address", "address"),
    ],
)
def test_bad_params_fail_when_the_config_is_parsed_and_when_the_composer_is_built(params, at, detail):
    with pytest.raises(ValueError, match=rf"components\.remote\.params\.{at}\n"):
        RewardConfig.model_validate({"components": {"remote": {"params": params}}})
    with pytest.raises(ValueError, match=rf"reward component 'remote': bad params .*{detail}"):
        RewardComposer({"remote": {"params": params}})


def test_a_job_spec_cannot_point_the_reward_service_at_servers(tmp_path):
    spec = JobSpec.model_validate({"reward": {"components": {"remote": {"params": {"servers": {"x": "evil:1"}}}}}})
    with pytest.raises(SpecNotAllowed) as info:
        SpecPolicy([tmp_path]).apply(spec)
    assert info.value.loc == ("reward", "components", "remote", "params", "servers")
    renamed = {"reward": {"components": {"scorer": {"type": "remote", "params": {"servers": {"x": "evil:1"}}}}}}
    with pytest.raises(SpecNotAllowed) as info:
        SpecPolicy([tmp_path]).apply(JobSpec.model_validate(renamed))  # under another name, the same function
    assert info.value.loc == ("reward", "components", "scorer", "params", "servers")
