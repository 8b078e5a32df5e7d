"""Task ranges (what a server serves), the splits generated inside them, how a family's server says a task
is not valid, and the crafting vocabulary knob."""

import pytest

from services.common.config import EnvConfig
from services.envs.agentgym.env import AgentGymEnv
from services.envs.agentgym.profiles import PROFILES
from services.envs.builtin.crafting import RAW, Crafting, plan
from services.envs.datasets import split_range


def agentgym(family, **options):
    return EnvConfig(name="agentgym", options={"family": family, "base_url": "http://127.0.0.1:1", **options})


def test_family_ranges_and_overrides():
    assert AgentGymEnv.task_range(agentgym("maze").options) == range(0, 25)
    assert AgentGymEnv.task_range(agentgym("textcraft").options) is None
    assert AgentGymEnv.task_range(agentgym("webshop", task_range=[0, 500]).options) == range(0, 500)
    assert AgentGymEnv.task_range({"family": "nethack"}) is None  # bad options fail at reset, not here
    with pytest.raises(ValueError, match="task_range"):
        agentgym("maze", task_range=[5, 5])


def test_generated_splits_stay_inside_the_range():
    maze = agentgym("maze")  # default sizes: 10000 train, 32 validation
    assert split_range(maze, "train") == range(0, 20) and split_range(maze, "validation") == range(20, 25)
    small = maze.model_copy(update={"train_tasks": 10, "validation_tasks": 4})
    assert split_range(small, "train") == range(0, 10) and split_range(small, "validation") == range(10, 14)
    shifted = agentgym("webshop", task_range=[100, 110])
    assert split_range(shifted, "train") == range(100, 108) and split_range(shifted, "validation") == range(108, 110)
    unbounded = agentgym("textcraft")
    assert split_range(unbounded, "train") == range(10000) and split_range(unbounded, "validation") == range(
        10000, 10032
    )


@pytest.mark.parametrize(
    "text, rejected",
    [
        ("", True),
        ("The game 26 is not valid.", True),
        ("list index out of range", True),
        ("env 3 does not exist", False),
    ],
)
def test_maze_recognises_the_real_servers_invalid_task_replies(text, rejected):
    assert PROFILES["maze"].rejects_task(text) is rejected
    assert PROFILES["textcraft"].rejects_task(text) is (text == "list index out of range")


@pytest.mark.parametrize(
    "text, rejected",
    [
        ("list index out of range", True),  # ALFWorld's games[game], SciWorld's games[data_idx]
        ('world_type must be one of "Text", "Embody" and "Hybrid"', False),
        ("The id 3 is not valid.", False),  # an environment id, not the task
    ],
)
def test_alfworld_and_sciworld_reject_an_index_past_their_loaded_list(text, rejected):
    for family in ("alfworld", "sciworld"):
        assert PROFILES[family].rejects_task(text) is rejected
    assert PROFILES["alfworld"].probe_range and not PROFILES["sciworld"].probe_range  # its list grows


def test_alfworld_resets_with_the_fields_its_server_requires():
    alfworld = PROFILES["alfworld"]
    assert (alfworld.task_field, alfworld.reset_extra) == ("game", {"world_type": "Text"})
    assert AgentGymEnv.task_range(agentgym("alfworld").options) is None  # no server answers the probe
    assert AgentGymEnv.task_range(agentgym("alfworld", task_range=[0, 140]).options) == range(0, 140)


def test_maze_cleans_case_and_spacing_only():
    maze = PROFILES["maze"]
    assert maze.clean_action("  Move   RIGHT ") == "move right" and maze.clean_action("up") not in maze.valid_actions


def test_crafting_vocabulary_draws_from_the_same_few_names():
    options = {"depth": 1, "fan_in": 1, "distractors": 1, "slack": 2, "vocabulary": 3}
    raw_seen, items_seen = set(), set()
    for task in range(60):
        env = Crafting()
        observation = env.reset(task, options)
        items_seen |= set(env.recipes)
        raw_seen |= {name for recipe in env.recipes.values() for name, _ in recipe.ingredients if name in RAW}
        for action in plan(env.goal, env.recipes):  # still solvable by the plan
            result = env.step(action)
        assert result.success, observation
    assert raw_seen <= set(RAW[:3]) and len(items_seen) == 3
    default = Crafting()
    default.reset(0, {})
    again = Crafting()
    again.reset(0, {"vocabulary": None})
    assert default.recipes == again.recipes
