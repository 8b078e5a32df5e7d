"""Crafting in the style of TextCraft: fetch raw materials and craft them, through a recipe tree, into
a goal item.

Each task draws, from its seed, a recipe tree `depth` levels deep (every crafted item needs 1 to
`fan_in` ingredients, the first one a level lower, so the goal really is `depth` crafts away from raw
materials) plus `distractors` recipes that lead nowhere; the first observation lists every crafting
command in a shuffled order, as TextCraft does. Actions:
  get N <item>                          raw materials only (items without a crafting command)
  craft N <item> using A <x>, B <y>     N a multiple of the recipe's output; counts scale with N
  inventory
The turn limit is the shortest plan (one `get` per raw material, one `craft` per crafted item) plus
`slack`. Reward 1 and success once the goal item is in the inventory, else 0.

Difficulty: `depth`, `fan_in`, `distractors`, `slack`, and `vocabulary` (how many raw materials and item
names tasks draw from; a few are easier for a small model, which must write them out exactly).
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from dataclasses import dataclass

from pydantic import Field

from services.envs.base import EnvOptions, StepResult, TextEnv, action_format
from services.envs.registry import register_env

RAW = [
    "oak log",
    "birch log",
    "cobblestone",
    "iron ore",
    "gold ore",
    "coal",
    "sand",
    "clay ball",
    "string",
    "feather",
    "flint",
    "leather",
    "wool",
    "redstone dust",
    "lapis lazuli",
    "sugar cane",
    "wheat",
    "bone",
    "slime ball",
    "glowstone dust",
    "quartz",
    "copper ore",
    "reed",
    "amber",
]
ADJECTIVES = [
    "polished",
    "sturdy",
    "glowing",
    "woven",
    "carved",
    "gilded",
    "smooth",
    "bright",
    "tiny",
    "heavy",
    "hollow",
    "sharp",
]
NOUNS = [
    "plank",
    "rod",
    "brick",
    "lantern",
    "pickaxe",
    "rope",
    "panel",
    "gear",
    "block",
    "tile",
    "dye",
    "torch",
    "bowl",
    "hinge",
    "lens",
    "frame",
]
CRAFT = re.compile(r"craft\s+(\d+)\s+(.+?)\s+using\s+(.+)")
GET = re.compile(r"get\s+(\d+)\s+(.+)")
COUNTED = re.compile(r"(\d+)\s+(.+)")


@dataclass(frozen=True)
class Recipe:
    output: int
    ingredients: tuple[tuple[str, int], ...]

    def command(self, item: str, times: int = 1) -> str:
        parts = ", ".join(f"{count * times} {name}" for name, count in self.ingredients)
        return f"craft {self.output * times} {item} using {parts}"


class CraftingOptions(EnvOptions):
    depth: int = Field(1, ge=1, le=4)
    """Crafting levels between raw materials and the goal."""
    fan_in: int = Field(2, ge=1, le=3)
    """Most ingredients one recipe needs."""
    distractors: int = Field(2, ge=0, le=10)
    """Recipes listed that the goal does not need."""
    slack: int = Field(3, ge=0, le=100)
    """Actions allowed beyond the shortest plan."""
    vocabulary: int | None = Field(None, ge=2, le=len(RAW))
    """Raw materials, and crafted-item names, that tasks draw from (the same few in every task); default all."""


def generate(seed: int, opts: CraftingOptions) -> tuple[str, dict[str, Recipe]]:
    rng = random.Random(f"crafting:{seed}")
    names = [f"{a} {n}" for a in ADJECTIVES for n in NOUNS]
    raw = RAW
    if opts.vocabulary:  # the same few names first in every task; more only for trees that need them
        random.Random("crafting-vocabulary").shuffle(names)
        vocab, rest, raw = names[: opts.vocabulary], names[opts.vocabulary :], RAW[: opts.vocabulary]
        rng.shuffle(vocab)
        names = rest + vocab  # make() pops from the end
    else:
        rng.shuffle(names)
    recipes: dict[str, Recipe] = {}

    def make(level: int) -> str:
        if level == 0:
            return rng.choice(raw)
        item = names.pop()
        ingredients: dict[str, int] = {}
        for i in range(rng.randint(1, opts.fan_in)):
            ingredient = make(level - 1 if i == 0 else rng.randint(0, level - 1))
            if ingredient not in ingredients:
                ingredients[ingredient] = rng.choice([1, 1, 2, 3])
        recipes[item] = Recipe(rng.choice([1, 1, 2, 4]), tuple(ingredients.items()))
        return item

    goal = make(opts.depth)
    for _ in range(opts.distractors):
        make(rng.randint(1, opts.depth))
    return goal, recipes


def plan(goal: str, recipes: dict[str, Recipe]) -> list[str]:
    """A shortest action list that crafts one goal item: every raw material fetched once, every crafted
    item crafted once, in an order where ingredients come first."""
    order: list[str] = []

    def visit(item: str) -> None:
        if item in recipes and item not in order:
            for ingredient, _ in recipes[item].ingredients:
                visit(ingredient)
            order.append(item)

    visit(goal)
    need: Counter[str] = Counter({goal: 1})
    times: dict[str, int] = {}
    for item in reversed(order):  # parents before children, so each total is complete when used
        recipe = recipes[item]
        times[item] = math.ceil(need[item] / recipe.output)
        for ingredient, count in recipe.ingredients:
            need[ingredient] += count * times[item]
    gets = [f"get {need[raw]} {raw}" for raw in sorted(need) if raw not in recipes]
    return gets + [recipes[item].command(item, times[item]) for item in order]


@register_env("crafting")
class Crafting(TextEnv):
    description = "Fetch raw materials and craft them into a goal item (TextCraft style)."
    max_turns = 8
    runs_inline = True
    Options = CraftingOptions

    def reset(self, task_index: int, options: dict) -> str:
        self.opts = opts = self.parse_options(options)
        self.goal, self.recipes = generate(task_index, opts)
        self.optimal = len(plan(self.goal, self.recipes))
        self.max_turns, self.turn, self.inventory = self.optimal + opts.slack, 0, Counter()
        commands = [recipe.command(item) for item, recipe in self.recipes.items()]
        random.Random(f"crafting-order:{task_index}").shuffle(commands)
        return (
            "Crafting commands:\n"
            + "\n".join(commands)
            + f"\nGoal: craft 1 {self.goal} within {self.max_turns} actions. Items that no command crafts are raw "
            f"materials: fetch them with get N <item>. Craft with craft N <item> using <ingredients>, or list "
            f"what you hold with inventory. {action_format('get 2 ' + RAW[0])}"
        )

    def task_info(self) -> dict:
        return {"goal": self.goal, "shortest_plan": self.optimal}

    def anchor_observation(self) -> str:
        """The inventory: what a state of this task is (the recipes are the task's)."""
        return self._inventory_text()

    def random_action(self, rng: random.Random) -> str:
        item = rng.choice(list(self.recipes))
        raw = [name for name, _ in self.recipes[item].ingredients if name not in self.recipes]
        choices = ["inventory", self.recipes[item].command(item)]
        if raw:
            choices.append(f"get {rng.randint(1, 4)} {rng.choice(raw)}")
        return rng.choice(choices)

    def step(self, action: str) -> StepResult:
        self.turn += 1
        text, valid = self._act(" ".join(action.lower().split()))
        info = {"turn": self.turn, "action_valid": valid}
        if self.inventory[self.goal] > 0:
            return StepResult(f"{text} You crafted the goal, {self.goal}!", 1.0, True, True, info)
        if self.turn >= self.max_turns:
            return StepResult(f"{text} Out of actions.", 0.0, True, False, info)
        return StepResult(text, 0.0, False, False, info)

    def _act(self, action: str) -> tuple[str, bool]:
        if action == "inventory":
            return self._inventory_text(), True
        if m := GET.fullmatch(action):
            count, item = int(m.group(1)), m.group(2)
            if count < 1 or item in self.recipes or item not in RAW:
                return f"Could not find {item} to get; only raw materials can be fetched.", True
            self.inventory[item] += count
            return f"Got {count} {item}.", True
        if m := CRAFT.fullmatch(action):
            return self._craft(int(m.group(1)), m.group(2), m.group(3)), True
        return (
            f"Invalid action {action[:60]!r}: use get N <item>, craft N <item> using <ingredients>, or inventory."
        ), False

    def _inventory_text(self) -> str:
        held = ", ".join(f"{n} {item}" for item, n in sorted(self.inventory.items()) if n) or "nothing"
        return f"Inventory: {held}."

    def _craft(self, count: int, item: str, using: str) -> str:
        recipe = self.recipes.get(item)
        if recipe is None:
            return f"There is no crafting command for {item}."
        given: dict[str, int] = {}
        for part in using.split(","):
            m = COUNTED.fullmatch(part.strip())
            if not m:
                return f"Could not read the ingredient {part.strip()!r}; write it as N <item>."
            given[m.group(2)] = given.get(m.group(2), 0) + int(m.group(1))
        times, rest = divmod(count, recipe.output)
        if count < 1 or rest or given != {name: n * times for name, n in recipe.ingredients}:
            return (
                f"Wrong ingredients for {count} {item}; the command is: {recipe.command(item)} (scaled by the count)."
            )
        missing = [f"{n - self.inventory[name]} {name}" for name, n in given.items() if self.inventory[name] < n]
        if missing:
            return f"Could not craft {count} {item}: missing {', '.join(missing)}."
        self.inventory.subtract(given)
        self.inventory[item] += count
        return f"Crafted {count} {item}."
