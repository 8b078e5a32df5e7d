"""Fake AgentGym servers written from shared/agentgym-protocol.md, one per family shape:
TextCraft-style, BabyAI-style, LMRL-Gym (maze + wordle under route prefixes), WebShop-style, and
ALFWorld/SciWorld-style (a loaded list of FAKE_GAMES tasks, default 13, indexed by the task).

    python tests/support/agentgym_fake.py <textcraft|babyai|lmrl|webshop|alfworld|sciworld> <port>

Every game is the same small one so a scripted policy can win it: each observation ends with
`Next: <action>`, and task (data_idx / game / seed / session_id) k needs 2 + k % 2 right actions.
Test hooks, as actions: `explode` (HTTP 200 with {"error": ...}), `sleep` (answers after 30 s),
`crash` (an exception outside the try blocks: HTTP 500). WebShop adds POST /__restart (forgets every
environment, as a restarted process would) and hands out ids again past FAKE_MAX_ENVS creations;
TextCraft, BabyAI and LMRL-Gym add GET /__live (environments not closed; LMRL-Gym has no /close, so
every one it created) and GET /__stats (most requests in flight at once, step calls received).

Behaviour of the real servers (shared/agentgym-protocol.md, "Behaviour seen"), always on: maze serves
games 0..24 only (25: an empty error text, 26 and above: "The game N is not valid.") and ignores any
action but its four moves without a word; Wordle lists its filtered vocabulary; ALFWorld needs `game`
and `world_type` at reset and has no /close; ALFWorld and SciWorld answer "list index out of range" for
a task past their list. Switched on by environment variables: FAKE_HANG_TASKS
(comma-separated BabyAI data_idx whose reset never answers, as 1000000234 did, holding its worker thread),
FAKE_SLOW_S (every request takes FAKE_SLOW_S x (requests in flight)^2 seconds: a server that slows down with
concurrency), FAKE_THREADS (worker threads for the sync routes, default 40 as a real server has; `GET /` needs
one too) and FAKE_CLOSE_FAILS (the first N /close calls fail with HTTP 500). BabyAI's /close answers false for
an environment created but never reset, and keeps it, as the real one does. Ids count up from 0 in each
process: a server killed and started again on its port hands out the same ids again, as a real one does."""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import time
from typing import Any

import anyio
import uvicorn
from fastapi import Body, FastAPI, Query, Request

MAZE_GAMES = 25
MAZE_MOVES = ("move up", "move down", "move left", "move right")
HANG_TASKS = {int(t) for t in os.environ.get("FAKE_HANG_TASKS", "").split(",") if t.strip()}
SLOW_S = float(os.environ.get("FAKE_SLOW_S", "0"))
THREADS = int(os.environ.get("FAKE_THREADS", "40"))
"""Worker threads for the sync routes, as AnyIO gives a real server (40): a hung reset holds one for good."""

ACTIONS = {
    "textcraft": "get 1 plank",
    "babyai": "move forward",
    "maze": "move up",
    "wordle": "c r a n e",
    "webshop": "click[buy now]",
    "alfworld": "look",
    "sciworld": "look around",
}
WORDLE_VOCABULARY = ["crane", "frown", "light"]
GAMES = int(os.environ.get("FAKE_GAMES", "13"))
CLOSE_FAILS = int(os.environ.get("FAKE_CLOSE_FAILS", "0"))


class Game:
    def __init__(self, family: str, task: int):
        self.family, self.needed, self.progress, self.done = family, 2 + task % 2, 0, False
        self.actions: list[str] = []

    def observation(self, text: str = "") -> str:
        return f"{text}{self.family} task: {self.needed - self.progress} to go. Next: {ACTIONS[self.family]}"

    def step(self, action: str) -> tuple[str, float, bool]:
        self.actions.append(action)
        if self.family == "maze" and action not in MAZE_MOVES:  # ignored without a word, as the real one does
            return self.observation(), -1.0, False
        if action == "crash":
            raise RuntimeError("crash requested")
        if action == "sleep":
            time.sleep(30)
        if action == ACTIONS[self.family]:
            self.progress += 1
        else:
            return self.observation(f"Nothing happens ({action!r}). "), self._reward(False), False
        self.done = self.progress >= self.needed
        return ("Task complete." if self.done else self.observation()), self._reward(self.done), self.done

    def _reward(self, won: bool) -> float:
        if self.family == "maze":
            return 0.0 if won else -1.0
        if self.family == "wordle":  # the server adds 1 to any reward of 0 or less
            raw = 0.0 if won else -1.0
            return raw + 1 if raw <= 0 else raw
        return 1.0 if won else 0.0


def instrument(app: FastAPI) -> FastAPI:
    """Counts requests in flight (and the most at once); with FAKE_SLOW_S each one takes longer the more
    run at once, as a one-worker AgentGym server does."""
    app.state.in_flight, app.state.peak, app.state.steps, app.state.closes, app.state.resets = 0, 0, 0, 0, 0
    app.state.hung_resets = 0

    @app.middleware("http")
    async def load(request: Request, call_next):
        anyio.to_thread.current_default_thread_limiter().total_tokens = THREADS  # the loop's own limiter
        if request.url.path.startswith("/__") or request.url.path == "/":  # test hooks and health probes
            return await call_next(request)
        app.state.in_flight += 1
        app.state.peak = max(app.state.peak, app.state.in_flight)
        app.state.steps += request.url.path.endswith("/step")
        app.state.closes += request.url.path.endswith("/close")
        app.state.resets += request.url.path.endswith("/reset")
        try:
            if SLOW_S:
                await asyncio.sleep(SLOW_S * app.state.in_flight**2)
            return await call_next(request)
        finally:
            app.state.in_flight -= 1

    @app.get("/__stats")
    def stats() -> dict:
        return {
            "peak_in_flight": app.state.peak,
            "steps": app.state.steps,
            "closes": app.state.closes,
            "resets": app.state.resets,
            "hung_resets": app.state.hung_resets,
        }

    return app


def textcraft_style(family: str) -> FastAPI:
    app, envs, ids = instrument(FastAPI()), {}, itertools.count()
    app.state.envs = envs

    @app.get("/")
    def hello() -> str:
        return f"This is the environment server of {family}."

    @app.post("/create")
    def create(body: dict | None = Body(None)) -> Any:
        env_id = next(ids)
        if family == "textcraft":  # already reset with data_idx = id
            envs[env_id] = Game(family, env_id)
            return {"id": env_id, "observation": envs[env_id].observation(), "done": False, "reward": 0}
        envs[env_id] = None  # BabyAI builds the environment only at reset
        return {"id": env_id}

    @app.post("/reset")
    def reset(body: dict = Body(...)) -> Any:
        if family == "babyai" and body.get("data_idx") in HANG_TASKS:
            app.state.hung_resets += 1
            time.sleep(3600)  # the real server spins on such a level until restarted
        try:
            envs[body["id"]] = game = Game(family, body["data_idx"] if family == "babyai" else body.get("data_idx", 0))
        except KeyError as exc:
            return {"error": f"KeyError {exc}"}
        if family == "babyai":
            return {"observation": game.observation(), "reward": 0.0, "score": 0.0, "deleted": False, "done": False}
        return {"id": body["id"], "observation": game.observation(), "done": False, "reward": 0}

    @app.post("/step")
    def step(body: dict = Body(...)) -> Any:
        game = envs.get(body.get("id"))
        if game is None:
            return {"error": f"env {body.get('id')} does not exist"}
        if body["action"] == "crash":
            game.step("crash")  # outside any try block: FastAPI answers 500
        try:
            if game.done:
                raise ValueError("the episode is finished")
            if body["action"] == "explode":
                raise ValueError("exploded on request")
            observation, reward, done = game.step(body["action"])
        except Exception as exc:  # noqa: BLE001 - the servers' own habit: errors inside a 200
            return {"error": str(exc)}
        reply = {"observation": observation, "reward": reward, "done": done}
        return {**reply, "score": reward} if family == "babyai" else reply

    @app.get("/observation")
    def observation(id: int = Query(...)) -> Any:
        return envs[id].observation() if envs.get(id) else {"error": "no such env"}

    if not os.environ.get("FAKE_NO_CLOSE"):  # an older server of the family, without /close

        @app.post("/close")
        def close(body: dict = Body(...)) -> bool:
            app.state.closes_asked = getattr(app.state, "closes_asked", 0) + 1
            if app.state.closes_asked <= CLOSE_FAILS:
                raise RuntimeError("close failed on request")  # HTTP 500
            if family == "babyai" and envs.get(body.get("id"), "missing") is None:
                return False  # created, never reset: BabyAI refuses to close it and keeps it
            return envs.pop(body.get("id"), "missing") != "missing"

    @app.get("/__live")
    def live() -> int:
        return len(envs)

    return app


def lmrl_style() -> FastAPI:
    app, envs = instrument(FastAPI()), {"maze": {}, "wordle": {}}
    app.state.envs = envs

    @app.get("/__live")
    def live() -> int:
        return sum(len(table) for table in envs.values())

    @app.get("/")
    def hello() -> str:
        return "This is the environment server of LMRL-Gym."

    for game_name, task_field in (("maze", "game"), ("wordle", "seed")):

        def routes(game_name=game_name, task_field=task_field):
            table = envs[game_name]

            @app.post(f"/{game_name}/create")
            def create() -> Any:
                table[len(table)] = None
                return {"id": len(table) - 1}

            @app.post(f"/{game_name}/reset")
            def reset(body: dict = Body(...)) -> Any:
                task = body[task_field]
                if game_name == "maze" and task == MAZE_GAMES:  # an assertion with no message fails inside
                    return {"error": ""}
                if game_name == "maze" and not 0 <= task < MAZE_GAMES:
                    return {"error": f"The game {task} is not valid."}
                table[body["id"]] = game = Game(game_name, task)
                reply = {"observation": game.observation()}
                return {"id": body["id"], **reply} if game_name == "wordle" else reply

            @app.post(f"/{game_name}/step")
            def step(body: dict = Body(...)) -> Any:
                game = table.get(body["id"])
                try:
                    if game is None or game.done:
                        raise ValueError("no running episode")
                    if body["action"] == "explode":
                        raise ValueError("exploded on request")
                    observation, reward, done = game.step(body["action"])
                except Exception as exc:  # noqa: BLE001
                    return {"error": str(exc)}
                return {"observation": observation, "reward": reward, "done": done}

            if game_name == "wordle":

                @app.get("/wordle/filtered_vocab")
                def filtered_vocab(id: int = Query(...)) -> Any:
                    return WORDLE_VOCABULARY if id in table else {"error": f"The id {id} is not valid."}

            @app.get(f"/{game_name}/available_actions")
            def available_actions() -> list[str]:
                return ["move left", "move right", "move up", "move down"]

        routes()
    return app


def webshop_style() -> FastAPI:
    app = FastAPI()
    app.state.envs, app.state.created = {}, 0
    max_envs = int(os.environ.get("FAKE_MAX_ENVS", "8000"))

    @app.get("/")
    def hello() -> str:
        return "This is the environment server of WebShop."

    @app.post("/create")
    def create() -> int:
        env_id = app.state.created % max_envs  # past the limit, ids are handed out again
        app.state.created += 1
        app.state.envs[env_id] = None
        return env_id

    @app.post("/reset")
    def reset(body: dict = Body(...)) -> Any:
        app.state.envs[body["env_idx"]] = game = Game("webshop", body.get("session_id") or 0)
        return [game.observation("WebShop [SEP] Instruction: buy shoes [SEP] "), None]

    @app.post("/step")
    def step(body: dict = Body(...)) -> Any:
        game = app.state.envs.get(body["env_idx"])
        try:
            if game is None:
                raise ValueError("no such env")
            if body["action"] == "explode":
                raise ValueError("exploded on request")
            state, reward, done = game.step(body["action"])
        except Exception as exc:  # noqa: BLE001
            return {"error": str(exc)}
        return {"state": state, "reward": reward, "done": done, "info": None}

    @app.get("/available_actions")
    def available_actions(env_idx: int = Query(...)) -> Any:
        return {"has_search_bar": True, "clickables": ["buy now", "back to search"]}

    @app.post("/__restart")
    def restart() -> bool:
        app.state.envs.clear()
        app.state.created = 0
        return True

    return app


def listed_style(family: str) -> FastAPI:
    """A server that indexes a list it loaded with the task, as ALFWorld (`game`, plus a required
    `world_type`) and SciWorld (`data_idx`) do; only SciWorld has /close."""
    app, envs, games, ids = instrument(FastAPI()), {}, list(range(GAMES)), itertools.count()
    task_field = "game" if family == "alfworld" else "data_idx"

    @app.get("/")
    def hello() -> str:
        return f"This is environment {family}."

    @app.post("/create")
    def create() -> Any:
        envs[env_id := next(ids)] = None
        return {"id": env_id}

    @app.post("/reset")
    def reset(body: dict = Body(...)) -> Any:
        if family == "alfworld" and body.get("world_type") not in ("Text", "Embody", "Hybrid"):
            return {"error": 'world_type must be one of "Text", "Embody" and "Hybrid"'}
        try:
            envs[body["id"]] = game = Game(family, games[body[task_field]])
        except (IndexError, KeyError) as exc:
            return {"error": str(exc)}
        return {"id": body["id"], "observation": game.observation()}

    @app.post("/step")
    def step(body: dict = Body(...)) -> Any:
        try:
            observation, reward, done = envs[body["id"]].step(body["action"])
        except Exception as exc:  # noqa: BLE001
            return {"error": str(exc)}
        return {"observation": observation, "reward": reward, "done": done}

    if family == "sciworld":

        @app.post("/close")
        def close(body: dict = Body(...)) -> bool:
            return envs.pop(body.get("id"), "missing") != "missing"

    @app.get("/__live")
    def live() -> int:
        return len(envs)

    return app


def build(shape: str) -> FastAPI:
    if shape in ("textcraft", "babyai"):
        return textcraft_style(shape)
    if shape in ("alfworld", "sciworld"):
        return listed_style(shape)
    return {"lmrl": lmrl_style, "webshop": webshop_style}[shape]()


if __name__ == "__main__":
    uvicorn.run(build(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), workers=1, log_level="warning")
