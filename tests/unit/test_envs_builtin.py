"""The built-in catalogue beyond corridor/guess_number: for each env a scripted optimal policy reaches
success, invalid actions are handled (they cost a turn, never raise), and seeds reproduce tasks."""

import random
import re
from collections import Counter

import pytest

from services.envs.base import InvalidTask
from services.envs.builtin.babyai import BabyAI
from services.envs.builtin.crafting import Crafting, plan
from services.envs.builtin.maze import Maze, shortest_path
from services.envs.builtin.reasoning import Reasoning
from services.envs.builtin.wordle import Wordle, feedback, word_list
from services.envs.registry import ENVS

BUILTINS = ["corridor", "guess_number", "maze", "wordle", "crafting", "reasoning", "babyai"]


def play(env, actions):
    result = None
    for action in actions:
        result = env.step(action)
        if result.done:
            break
    return result


def test_catalogue_has_every_builtin_with_an_action_format_and_random_actions():
    assert set(BUILTINS) <= set(ENVS.names())
    rng = random.Random(0)
    for name in BUILTINS:
        env = ENVS.create(name)
        first = env.reset(3, {})
        assert "<action>" in first and "</action>" in first, name
        assert env.description and env.max_turns >= 1
        for _ in range(env.max_turns):  # random actions are always well-formed for the env
            result = env.step(env.random_action(rng))
            assert result.info.get("action_valid", True), (name, result.observation)
            if result.done:
                break


@pytest.mark.parametrize("name", BUILTINS)
def test_same_seed_same_task_and_seeds_differ(name):
    tasks = []
    for seed in range(12):
        runs = []
        for _ in range(2):
            env = ENVS.create(name)
            seen, rng = [env.reset(seed, {})], random.Random(0)  # the same actions for every seed
            for _ in range(3):
                result = env.step(env.random_action(rng))
                seen.append((result.observation, result.reward, result.done))
                if result.done:
                    break
            runs.append(seen)
        assert runs[0] == runs[1], (name, seed)
        tasks.append(repr(runs[0]))
    assert len(set(tasks)) >= 4, name


# -- maze --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"size": 8, "wall_density": 0.4, "slack": 0}, {"hint": False}])
def test_maze_shortest_path_always_succeeds(options):
    for seed in range(200):
        env = Maze()
        env.reset(seed, options)
        moves = shortest_path(env.walls, env.opts.size, env.position, env.goal)
        assert len(moves) == env.optimal <= env.max_turns
        result = play(env, moves)
        assert (result.done, result.success, result.reward) == (True, True, 1.0), seed


def test_maze_walls_invalid_actions_and_limits():
    env = Maze()
    first = env.reset(4, {"size": 6, "show_map": True})
    assert first.count("\n") >= 6 and "A" in env.render() and "G" in env.render()
    start = env.position
    result = env.step("jump")
    assert "Invalid action 'jump'" in result.observation and result.info["action_valid"] is False
    assert env.position == start
    blocked = [m for m in ("up", "down", "left", "right") if m not in env.open_moves()]
    if blocked:
        assert env.step(blocked[0]).observation.startswith("You bump into a wall.") and env.position == start
    while not result.done:
        result = env.step("xyz")
    assert not result.success and env.turn == env.max_turns
    with pytest.raises(InvalidTask):
        Maze().reset(0, {"size": 2})


def test_maze_observation_knobs():
    env = Maze()
    first = env.reset(9, {"show_open": False, "hint": False})
    assert "Open:" not in first and "The goal is" not in first and "#" not in first
    assert "Open:" in Maze().reset(9, {}) and "The goal is" in Maze().reset(9, {})


def test_maze_guide_names_a_first_move_of_a_shortest_path():
    for seed in range(50):
        env = Maze()
        text = env.reset(seed, {"guide": True})
        result = None
        while result is None or not result.done:
            move = text.rsplit("Next move: ", 1)[1].rstrip(".")
            result = env.step(move)
            text = result.observation
        assert result.success and env.turn == env.optimal, seed  # every guided move shortened the path
    assert "Next move" not in Maze().reset(0, {})


def test_maze_difficulty_knob_lengthens_paths():
    def mean_path(options):
        lengths = []
        for seed in range(100):
            env = Maze()
            env.reset(seed, options)
            lengths.append(env.optimal)
        return sum(lengths) / len(lengths)

    assert mean_path({"size": 4}) < mean_path({"size": 8}) < mean_path({"size": 12})


# -- wordle ------------------------------------------------------------------------------------------
def test_wordle_feedback_follows_the_rules_for_repeated_letters():
    assert feedback("crane", "crane") == "GGGGG"
    assert feedback("speed", "abide") == "__Y_Y"  # the secret's one e is claimed by the first e
    assert feedback("eerie", "there") == "Y_Y_G"  # the green e is counted before any yellow
    assert feedback("aaaaa", "apple") == "G____"
    assert feedback("allee", "apple") == "GY__G"


def solve_wordle(env: Wordle) -> object:
    """Minimax guessing among the candidates still consistent with the feedback."""
    candidates = list(env.candidates)
    while True:

        def worst(guess, candidates=candidates):
            buckets = {}
            for secret in candidates:
                key = feedback(guess, secret)
                buckets[key] = buckets.get(key, 0) + 1
            return max(buckets.values()) - (guess in candidates) * 0.5

        guess = min(candidates if len(candidates) <= 2 else env.candidates, key=worst)
        result = env.step(" ".join(guess) if len(candidates) % 2 else guess)  # both spellings are accepted
        if result.done:
            return result
        marks = re.search(r"-> ([GY_]{5})", result.observation).group(1)
        candidates = [w for w in candidates if feedback(guess, w) == marks]


@pytest.mark.parametrize("vocabulary", [100, len(word_list())])
def test_wordle_minimax_solver_always_succeeds(vocabulary):
    secrets = set()
    for seed in range(40 if vocabulary <= 100 else 5):
        env = Wordle()
        env.reset(seed, {"vocabulary": vocabulary})
        result = solve_wordle(env)
        assert (result.success, result.reward) == (True, 1.0), (seed, env.secret)
        secrets.add(env.secret)
        assert env.secret in word_list()[:vocabulary]
    assert len(secrets) >= 5


def test_wordle_invalid_guesses_and_dictionary_mode():
    env = Wordle()
    env.reset(1, {"max_turns": 3, "dictionary_only": True})
    assert "not five letters" in env.step("cat").observation
    result = env.step("zzzzz")
    assert "not in the word list" in result.observation and result.info["action_valid"] is False
    result = env.step("qwert")
    assert result.done and not result.success and env.secret in result.observation
    open_env = Wordle()
    open_env.reset(1, {})
    assert open_env.step("zzzzz").info["action_valid"] is True
    with pytest.raises(InvalidTask):
        Wordle().reset(0, {"vocabulary": 0})


# -- crafting ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options", [{}, {"depth": 2, "fan_in": 3}, {"depth": 4, "fan_in": 3, "distractors": 6, "slack": 0}]
)
def test_crafting_plan_from_the_observation_always_succeeds(options):
    for seed in range(150):
        env = Crafting()
        first = env.reset(seed, options)
        # the solver reads only what the agent reads: the listed commands and the goal
        recipes = {}
        for line in first.splitlines():
            if line.startswith("craft "):
                from services.envs.builtin.crafting import COUNTED, CRAFT, Recipe

                m = CRAFT.fullmatch(line)
                parts = [COUNTED.fullmatch(p.strip()) for p in m.group(3).split(",")]
                recipes[m.group(2)] = Recipe(int(m.group(1)), tuple((p.group(2), int(p.group(1))) for p in parts))
        goal = re.search(r"Goal: craft 1 (.+?) within", first).group(1)
        actions = plan(goal, recipes)
        assert len(actions) == env.optimal <= env.max_turns
        result = play(env, actions)
        assert (result.done, result.success, result.reward) == (True, True, 1.0), (seed, actions)


def test_crafting_rejects_wrong_commands_without_raising():
    env = Crafting()
    env.reset(2, {"depth": 2})
    goal_recipe = env.recipes[env.goal]
    assert "Invalid action" in env.step("mine 3 diamonds").observation
    assert "Could not find" in env.step(f"get 1 {env.goal}").observation
    assert "missing" in env.step(goal_recipe.command(env.goal)).observation
    assert "Wrong ingredients" in env.step(f"craft 1 {env.goal} using 1 sand").observation
    assert "no crafting command" in env.step("craft 1 golden apple using 1 gold ore").observation
    result = env.step("inventory")
    assert result.observation.startswith("Inventory: nothing") and result.info["action_valid"]
    while not result.done:
        result = env.step("inventory")
    assert not result.success


def test_crafting_counts_scale_with_the_recipe_output():
    env = Crafting()
    env.reset(0, {})
    item = next(i for i, r in env.recipes.items() if all(n not in env.recipes for n, _ in r.ingredients))
    recipe = env.recipes[item]
    for name, count in recipe.ingredients:
        env.step(f"get {count * 2} {name}")
    assert env.step(recipe.command(item, 2)).observation.startswith(f"Crafted {recipe.output * 2} {item}.")
    assert env.inventory[item] == recipe.output * 2


# -- reasoning-gym -----------------------------------------------------------------------------------
def test_reasoning_right_answers_succeed_and_wrong_ones_fail():
    for seed in range(30):
        env = Reasoning()
        question = env.reset(seed, {})
        assert question.startswith("Calculate")
        result = env.step(f"  {env.answer} ")
        assert (result.done, result.success, result.reward) == (True, True, 1.0)
        env.reset(seed, {})
        result = env.step("not a number")
        assert result.done and not result.success and result.reward < 1.0


def test_reasoning_any_dataset_and_difficulty():
    env = Reasoning()
    hard = env.reset(5, {"dataset": "basic_arithmetic", "config": {"min_terms": 5, "max_terms": 6}})
    assert hard.count(" ") > Reasoning().reset(5, {}).count(" ")
    env.reset(0, {"dataset": "spell_backward"})
    assert env.step(env.answer).success
    for bad in ({"dataset": "no_such_dataset"}, {"config": {"min_terms": 0}}, {"size": 3}):
        with pytest.raises(InvalidTask):
            Reasoning().reset(0, bad)


def test_reasoning_random_actions_do_not_lean_to_the_answer():
    """The tiny model's warm-start trains on random actions: they must not be the right answer."""
    rng, right, yes = random.Random(0), 0, 0
    for seed in range(200):
        env = Reasoning()
        env.reset(seed, {"dataset": "syllogism"})
        action = env.random_action(rng)
        assert action in ("Yes", "No")
        right += action == env.answer
        yes += action == "Yes"
    assert 70 < right < 130 and 70 < yes < 130, (right, yes)
    env = Reasoning()
    env.reset(0, {"dataset": "spell_backward"})
    assert sorted(env.random_action(rng)) == sorted(env.answer)


def test_reasoning_without_the_package_says_how_to_install_it(monkeypatch):
    import builtins

    from services.envs.builtin import reasoning

    real_import = builtins.__import__

    def no_reasoning_gym(name, *args, **kwargs):
        if name == "reasoning_gym":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    reasoning._dataset.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_reasoning_gym)
    with pytest.raises(InvalidTask, match=r"pip install -e \"\.\[envs\]\""):
        Reasoning().reset(0, {"seed": 12345})
    reasoning._dataset.cache_clear()


# -- babyai ------------------------------------------------------------------------------------------
BOT_ACTIONS = {
    "left": "turn left",
    "right": "turn right",
    "forward": "go forward",
    "pickup": "pick up",
    "drop": "drop",
    "toggle": "toggle",
}


@pytest.mark.parametrize(
    "level", ["GoToRedBallNoDists", "BabyAI-GoToLocal-v0", "PickupLoc", "OpenDoor", "PutNextLocal"]
)
def test_babyai_expert_bot_succeeds_through_the_text_interface(level):
    from minigrid.utils.baby_ai_bot import BabyAIBot

    for seed in range(5):
        env = BabyAI()
        first = env.reset(seed, {"level": level, "max_turns": 300})
        assert "Mission:" in first and "turn left" in first
        bot = BabyAIBot(env.env.unwrapped)
        result = None
        while result is None or not result.done:
            result = env.step(BOT_ACTIONS[bot.replan().name])
        assert result.success and 0 < result.reward <= 1, (level, seed)
        env.close()


def test_babyai_text_describes_objects_relative_to_the_agent():
    env = BabyAI()
    first = env.reset(0, {})
    ball = re.search(r"a red ball (\d+) steps? ahead(?: and (\d+) steps? (left|right))?", first)
    assert ball, first
    before = int(ball.group(1))
    result = env.step("go forward")
    after = re.search(r"a red ball (\d+) steps? ahead", result.observation)
    if "Right in front of you: nothing" in first:
        assert after and int(after.group(1)) == before - 1


def test_babyai_invalid_actions_levels_and_turn_limit():
    env = BabyAI()
    env.reset(1, {"max_turns": 2})
    result = env.step("fly")
    assert "Invalid action 'fly'" in result.observation and not result.done
    result = env.step("turn left")
    assert result.done and not result.success
    with pytest.raises(InvalidTask, match="unknown BabyAI level"):
        BabyAI().reset(0, {"level": "NoSuchLevel"})


def test_the_documented_example_env_works_through_the_service(monkeypatch):
    """docs/environments.md's "Adding an environment" example, run as written (into a scratch registry,
    so the catalogue other tests see is unchanged)."""
    import asyncio
    import types
    from pathlib import Path

    from services.common.registry import Registry
    from services.envs import registry
    from services.envs.client import InProcessEnvClient
    from services.envs.service import EnvService

    scratch = Registry("environment")
    monkeypatch.setattr(registry, "ENVS", scratch)
    doc = (Path(__file__).resolve().parents[2] / "docs" / "environments.md").read_text()
    code = doc.split("## Adding an environment", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    module = types.ModuleType("coin_example")
    exec(compile(code, "docs/environments.md", "exec"), module.__dict__)
    assert scratch.get("coin") is module.Coin and "coin" not in ENVS.names()

    async def play():
        client = InProcessEnvClient(EnvService(envs=scratch))
        state = await client.create("coin", 4, {"flips": 2})
        while not state.done:
            state = await client.step(state.episode_id, re.search(r"will be (\w+)", state.observation).group(1))
        return state

    final = asyncio.run(play())
    assert final.success and final.reward == 1.0


def _bot_actions(seed: int, options: dict) -> list[str]:
    from minigrid.utils.baby_ai_bot import BabyAIBot

    env = BabyAI()
    env.reset(seed, options)
    bot, actions, result = BabyAIBot(env.env.unwrapped), [], None
    while result is None or not result.done:
        actions.append(BOT_ACTIONS[bot.replan().name])
        result = env.step(actions[-1])
    env.close()
    return actions


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_babyai_shaping_rewards_moving_to_the_ball_and_leaves_success_unchanged(seed):
    from services.envs.builtin.babyai import target_distance

    actions = _bot_actions(seed, {"max_turns": 64})
    plain, shaped = BabyAI(), BabyAI()
    plain.reset(seed, {"max_turns": 64})
    shaped.reset(seed, {"max_turns": 64, "shaping": 0.5})
    start, d_max = target_distance(shaped.env.unwrapped), shaped.d_max
    assert start > 0 and d_max == 14  # the level's 8x8 grid
    total = 0.0
    for action in actions:
        a, b = plain.step(action), shaped.step(action)
        assert b.info["shaping"] == pytest.approx(b.reward - a.reward)
        assert b.info["mission_reward"] == a.reward and (a.done, a.success) == (b.done, b.success)
        total += b.info["shaping"]
    assert b.success and b.done  # the bot completes the mission: the front cell is the ball, distance 0
    assert total == pytest.approx(0.5 * start / d_max) and total > 0


def test_babyai_shaping_penalises_walking_away_from_the_ball():
    for seed in range(100):
        env = BabyAI()
        first = env.reset(seed, {"shaping": 1.0, "compact": True})
        if re.search(r"red ball \d+ ahead\.", first) and "Front floor" in first:
            break
        env.close()
    else:
        pytest.fail("no task with the ball straight ahead")
    turned = [env.step("turn left").info["shaping"], env.step("turn left").info["shaping"]]
    assert sum(turned) == pytest.approx(-2 / env.d_max)  # the front cell moved from ahead to behind the agent
    result = env.step("go forward")
    if "Front wall" not in result.observation:
        assert result.info["shaping"] == pytest.approx(-1 / env.d_max) and result.reward < 0


def test_babyai_without_shaping_or_a_goto_target_adds_nothing():
    env = BabyAI()
    env.reset(0, {})
    assert env.step("turn left").reward == 0.0
    env = BabyAI()
    env.reset(0, {"level": "PickupLoc", "shaping": 1.0})
    assert env.distance is None and env.step("turn left").info["shaping"] == 0.0


def test_babyai_compact_observation_says_the_same_in_fewer_words():
    for seed in range(5):
        full, compact = BabyAI(), BabyAI()
        long, short = full.reset(seed, {}).splitlines()[-1], compact.reset(seed, {"compact": True}).splitlines()[-1]
        ball = re.search(r"a red ball (\d+) steps? ahead(?: and (\d+) steps? (left|right))?", long)
        if ball:
            side = f" {ball.group(2)} {ball.group(3)}" if ball.group(2) else ""
            assert f"red ball {ball.group(1)} ahead{side}." in short, (long, short)
        assert len(short) * 2 < len(long), (long, short)
        for action in ("go forward", "turn right"):
            assert len(compact.step(action).observation) * 2 < len(full.step(action).observation)


def test_babyai_moves_random_policy_only_moves_and_mostly_forward():
    rng, env = random.Random(0), BabyAI()
    env.reset(0, {"random_policy": "moves"})
    drawn = Counter(env.random_action(rng) for _ in range(2000))
    assert set(drawn) == {"go forward", "turn left", "turn right"}
    assert 900 < drawn["go forward"] < 1100
    env.reset(0, {})
    assert len({env.random_action(rng) for _ in range(200)}) == 6
