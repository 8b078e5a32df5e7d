"""Other reward services as one component (OpenRLHF's remote reward model): each trajectory scores the sum of the
totals that the reward services at `servers` give it, each server weighting its own components (a reward model or
a judge on pods of their own, the chart's `reward.servers`).

One Score call per server for each batch the composer hands over (several when the batch is larger than a request
may be), every call bounded by `timeout_s`: a server that is down fails the batch at once (gRPC UNAVAILABLE), one
that does not answer fails it after `timeout_s`, naming the server and its address; the reward service's own
`reward.timeout_s` should be the longer of the two. A server's per-turn (process) rewards count in its total; with
`per_turn` they pass through as this component's turn scores (summed over the servers), the rest of each server's
total (its episode-level components) on the episode's last turn."""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Annotated

from pydantic import Field

from services.common import trust
from services.reward.base import RewardFunction
from services.reward.client import GrpcRewardClient
from services.reward.composer import Scored

ADDRESS = r"^\S+:[0-9]{1,5}$"
ServerName = Annotated[str, Field(min_length=1, max_length=63)]
Address = Annotated[str, Field(pattern=ADDRESS, max_length=255)]
STOP_GRACE_S = 5.0
"""How long past `timeout_s` a batch may take before this side gives up on it, should a call outlive its deadline."""


class RemoteReward(RewardFunction):
    name = "remote"

    def __init__(
        self,
        servers: Annotated[
            dict[ServerName, Address], Field(min_length=1, max_length=64, json_schema_extra=trust.OPERATOR)
        ],
        timeout_s: Annotated[float, Field(gt=0, le=3600)] = 20.0,
        per_turn: bool = False,
    ):
        if not isinstance(servers, dict) or not servers:
            raise ValueError("servers must name at least one reward service: {name: host:port}")
        for server, address in servers.items():
            if not (isinstance(server, str) and server and isinstance(address, str) and re.fullmatch(ADDRESS, address)):
                raise ValueError(f"server {server!r}: {address!r} is not a reward service address (host:port)")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 3600:
            raise ValueError(f"timeout_s must be a number of seconds in (0, 3600], got {timeout_s!r}")
        if not isinstance(per_turn, bool):
            raise ValueError(f"per_turn must be true or false, got {per_turn!r}")
        self.servers, self.timeout_s, self.per_turn = dict(servers), float(timeout_s), per_turn
        # the clients are asyncio ones; the composer calls from worker threads: their calls run on this loop
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="remote-reward", daemon=True)
        self._thread.start()
        self._clients = {name: GrpcRewardClient(address, self.timeout_s) for name, address in self.servers.items()}

    def __call__(self, traj) -> float:
        return self.score_batch([traj])[0]

    def score_batch(self, trajs) -> list[float]:
        return [sum(s.total for s in scores) for scores in self._scores(trajs)]

    def score_turns_batch(self, trajs) -> list[list[float]]:
        out = []
        for traj, scores in zip(trajs, self._scores(trajs)):
            turns = [0.0] * len(traj.turns)
            for total, _, turn_scores in scores:
                for i, value in enumerate(turn_scores):
                    turns[i] += value
                if turns:
                    turns[-1] += total - sum(turn_scores)
            out.append(turns)
        return out

    def _scores(self, trajs) -> list[list[Scored]]:
        """Per trajectory, each server's score of it."""
        if not trajs:
            return []
        future = asyncio.run_coroutine_threadsafe(self._totals(list(trajs)), self._loop)
        try:
            return future.result(self.timeout_s + STOP_GRACE_S)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"reward servers {', '.join(self.servers)} gave no scores within {self.timeout_s:g}s"
            ) from None

    async def _totals(self, trajs) -> list[list[Scored]]:
        names = list(self._clients)
        replies = await asyncio.gather(*(self._clients[n].score(trajs) for n in names), return_exceptions=True)
        failed = [
            f"{name!r} at {self.servers[name]}: {type(reply).__name__}: {reply}"
            for name, reply in zip(names, replies)
            if isinstance(reply, BaseException)
        ]
        if failed:
            raise RuntimeError(f"reward server {'; '.join(failed)}")
        return [[scores[i] for scores in replies] for i in range(len(trajs))]

    def close(self) -> None:
        """Closes the channels and stops the loop (the service keeps a component for its life; tests close theirs)."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._close_clients(), self._loop).result(STOP_GRACE_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(STOP_GRACE_S)
        self._loop.close()

    async def _close_clients(self) -> None:
        for client in self._clients.values():
            await client.aclose()
