"""The built-in tool tasks (tool_arith, tool_lookup, tool_fix, tool_chain): tasks reproduce from their index,
answers are scored exactly, warm-start tool calls match the tools' argument schemas, the facts corpus names
every fact once (and BM25 finds it), and tool_fix reads its success from the workspace file."""

import random
import re
from collections import Counter

import pytest

from services.envs.base import InvalidTask
from services.envs.builtin.tool_fix import ToolFix
from services.envs.builtin.tool_lookup import facts
from services.envs.registry import ENVS
from services.envs.tools.corpora import CORPORA

TOOL_ENVS = ["tool_arith", "tool_lookup", "tool_fix", "tool_chain"]
ANSWERED = ["tool_arith", "tool_lookup", "tool_chain"]
SCHEMAS = {
    "calculator": {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
        "additionalProperties": False,
    },
    "python": {
        "type": "object",
        "properties": {"code": {"type": "string"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "search": {
        "type": "object",
        "properties": {"query": {"type": "string", "minLength": 1}},
        "required": ["query"],
        "additionalProperties": False,
    },
    "editor": {
        "type": "object",
        "properties": {
            "command": {"enum": ["view", "create", "str_replace", "insert"]},
            "path": {"type": "string"},
            "old_str": {"type": "string"},
            "new_str": {"type": "string"},
        },
        "required": ["command", "path"],
        "additionalProperties": False,
    },
}


def check_arguments(arguments, schema):
    try:
        import jsonschema
    except ImportError:
        assert isinstance(arguments, dict) and set(schema["required"]) <= set(arguments) <= set(schema["properties"])
        assert all(isinstance(value, str) for value in arguments.values())
    else:
        jsonschema.validate(arguments, schema)


def play(name, task_index, options=None):
    env = ENVS.create(name)
    return env, env.reset(task_index, options or {})


@pytest.mark.parametrize("name", TOOL_ENVS)
def test_same_index_same_task_and_indices_differ(name):
    seen = []
    for task_index in range(12):
        (a, first), (b, again) = play(name, task_index), play(name, task_index)
        assert first == again and a.task_info() == b.task_info(), (name, task_index)
        assert "<action>" in first and "</action>." in first  # the answer's format (tool_arith: before the question)
        seen.append(first)
    assert len(set(seen)) >= 11, name
    assert play(name, 3, {"seed": 1})[1] != play(name, 3)[1]


@pytest.mark.parametrize("name", ANSWERED)
def test_the_right_answer_succeeds_and_a_wrong_one_fails(name):
    for task_index in range(20):
        env, _ = play(name, task_index)
        answer = env.task_info()["answer"]
        result = env.step(f"  {int(answer):,} ")
        assert (result.reward, result.done, result.success) == (1.0, True, True), (name, task_index, answer)
        for wrong in (str(int(answer) + 1), "many", ""):
            env, _ = play(name, task_index)
            result = env.step(wrong)
            assert (result.reward, result.done, result.success) == (0.0, True, False), (name, wrong)


@pytest.mark.parametrize("name", TOOL_ENVS)
def test_random_tool_calls_and_actions_are_well_formed(name):
    rng = random.Random(0)
    for task_index in range(20):
        env, _ = play(name, task_index)
        types = {spec["type"] for spec in env.tools_for({}).values()}
        calls = env.random_tool_calls(rng)
        assert 1 <= len(calls) <= 2
        for tool, arguments in calls:
            assert tool in types, (name, tool)
            check_arguments(arguments, SCHEMAS[tool])
        action = env.random_action(rng)
        if name in ANSWERED:
            assert re.fullmatch(r"-?\d+", action) and len(action) == len(env.task_info()["answer"])
        else:
            assert action == "done"


def test_tool_arith_options_pick_operations_and_toolset():
    opts = {"digits": 8, "operations": ["*", "-"], "tool": "python"}
    env, first = play("tool_arith", 4, opts)
    a, op, b = re.search(r"What is \"(\d+)([-*])(\d+)\"\?", first).groups()
    assert len(a) == len(b) == 8 and "python tool" in first
    assert env.task_info()["answer"] == str(int(a) * int(b) if op == "*" else int(a) - int(b))
    (tool, arguments), *_ = env.random_tool_calls(random.Random(1))
    assert tool == "python" and a in arguments["code"] and b in arguments["code"]
    check_arguments(arguments, SCHEMAS["python"])
    for bad in ({"operations": ["/"]}, {"digits": 0}, {"tool": "abacus"}, {"operations": []}, {"colour": 1}):
        with pytest.raises(InvalidTask):
            play("tool_arith", 0, bad)


def test_tools_for_returns_the_declared_toolsets():
    def types(name, options=None):
        return sorted(spec["type"] for spec in ENVS.get(name).tools_for(options or {}).values())

    assert types("tool_arith") == ["calculator"] and types("tool_arith", {"tool": "python"}) == ["python"]
    assert types("tool_lookup") == ["search"] and types("tool_fix") == ["editor"]
    assert types("tool_chain") == ["calculator", "search"]
    assert ENVS.get("tool_lookup").tools_for({})["search"]["options"] == {"corpus": "builtin:facts"}
    assert ENVS.get("corridor").tools_for({}) == {}


def test_facts_corpus_names_each_fact_in_exactly_one_document():
    docs = CORPORA.get("facts")()
    assert len(docs) == len(facts()) == 500 and docs == CORPORA.get("facts")()
    assert len({doc["id"] for doc in docs}) == 500 and docs[0]["id"] == "fact-0001"
    for fact in facts():
        assert sum(fact.name in doc["text"] for doc in docs) == 1, fact
        assert fact.name in fact.question and str(fact.value) in fact.text
    for task_index in range(50):
        env, first = play("tool_lookup", task_index)
        assert env.fact.name in first and env.task_info()["answer"] == str(env.fact.value)


def test_bm25_ranks_the_questions_facts_first():
    bm25s = pytest.importorskip("bm25s")
    docs = CORPORA.get("facts")()
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize([doc["text"] for doc in docs], show_progress=False), show_progress=False)

    def top(question, k):
        found, _ = retriever.retrieve(bm25s.tokenize([question], show_progress=False), k=k, show_progress=False)
        return {docs[int(i)]["id"] for i in found[0]}

    for task_index in range(50):
        env, _ = play("tool_lookup", task_index)
        assert top(env.question, 1) == {env.fact.id}, env.question
        env, _ = play("tool_chain", task_index)
        assert top(env.question, 2) == {fact.id for fact in env.facts}, env.question


def fix_task(tmp_path, task_index=2):
    env = ToolFix()
    env.workspace = tmp_path
    env.reset(task_index, {})
    path = tmp_path / env.file
    assert path.read_text().splitlines() == env.lines
    return env, path


def test_tool_fix_succeeds_only_when_just_the_value_changed(tmp_path):
    env, path = fix_task(tmp_path)
    original = path.read_text()
    wrong_line = env.lines[env.line_index]
    assert f"Set {env.key} in {env.file} to {env.value}" in ToolFix().reset(2, {})

    result = env.step("done")  # no edit
    assert (result.reward, result.done, result.success) == (0.0, True, False)

    path.write_text(original.replace(wrong_line, f"{env.key}={env.value}"))
    result = env.step("done")
    assert (result.reward, result.done, result.success) == (1.0, True, True), result.observation

    other = next(i for i in range(1, len(env.lines)) if i != env.line_index)
    lines = path.read_text().splitlines()
    lines[other] += "0"
    path.write_text("\n".join(lines))
    assert not env.step("done").success

    path.write_text(original.replace(wrong_line, f"{env.key} = {env.value}0"))
    assert not env.step("done").success
    path.unlink()
    assert not env.step("done").success


def test_tool_fix_needs_a_workspace_to_score_but_not_for_its_prompt(tmp_path):
    env = ToolFix()
    first = env.reset(5, {"settings": 3})
    assert len(env.lines) == 4 and env.task_info() == {"file": env.file, "key": env.key, "value": env.value}
    with pytest.raises(InvalidTask, match="workspace"):
        env.step("done")
    other = ToolFix()
    other.workspace = tmp_path / "episode"
    assert other.reset(5, {"settings": 3}) == first
    assert (other.workspace / env.file).read_text() == "\n".join(env.lines) + "\n"


def test_datasets_are_written_for_the_tool_tasks():
    from services.common.config import EnvConfig
    from services.envs.datasets import generate_rows

    for name in TOOL_ENVS:
        rows = generate_rows(EnvConfig(name=name, train_tasks=3, validation_tasks=2), "validation")
        assert [row["task_index"] for row in rows] == [3, 4]
        assert all(row["prompt"][0]["content"] and row["reward_model"]["style"] == "rule" for row in rows)


def test_tool_arith_demos_draw_the_operator_from_six_and_mostly_answer_with_what_the_tool_said():
    env, first = play("tool_arith", 7, {"digits": 3})
    rng = random.Random(0)
    expressions = {env.random_tool_calls(rng)[0][1]["expression"] for _ in range(200)}
    a, b = re.search(r"What is \"(\d+)\+(\d+)\"", first).groups()
    assert expressions == {f"{a}{op}{b}" for op in ("+", "-", "*", "/", "//", "%")}
    answers = Counter(env.random_answer(rng, ["-1,234 and 77"]) for _ in range(900))
    assert set(answers) == {"-1234", a, b}
    assert 550 < answers["-1234"] < 650  # two times in three, the tool's first number
    assert len(env.random_answer(rng, [])) == len(env.task_info()["answer"])


def test_tool_lookup_demos_search_for_the_name_and_copy_a_hits_number_the_first_one_time_in_seven():
    env, _ = play("tool_lookup", 3)
    words = env.question.replace("?", "").split()
    rng = random.Random(0)
    queries = [env.random_tool_calls(rng)[0][1]["query"].split() for _ in range(900)]
    assert all(set(query) <= set(words) and env.fact.name in query and len(query) >= 3 for query in queries)
    assert all(query == sorted(query, key=words.index) for query in queries)  # in the question's order
    hits = (
        f"1. {env.fact.id}\n{env.fact.text}\n\n2. fact-0004\nThe island of Zaxtus has 19113 inhabitants."
        "\n\n3. fact-0009\nLake Brou is 20 metres deep.\n\n4. fact-0014\nLake Reil is 31 metres deep."
    )
    answers = [env.random_answer(rng, [hits]) for _ in range(1400)]
    counts = [answers.count(value) for value in (str(env.fact.value), "19113", "20", "31")]
    assert 150 < counts[0] < 250 and all(300 < n < 500 for n in counts[1:3]) and counts[3] == 0, counts
    made_up = [a for a in answers if a not in (str(env.fact.value), "19113", "20")]
    assert 300 < len(made_up) < 500 and all(len(a) == len(str(env.fact.value)) for a in made_up)
    one_hit = [env.random_answer(rng, [f"1. {env.fact.id}\n{env.fact.text}"]) for _ in range(700)]
    assert 50 < one_hit.count(str(env.fact.value)) < 150  # the missing hits' share is made up
    made_up = env.random_answer(rng, ["no document matches 'In which'"])
    assert made_up.isdigit() and len(made_up) == len(str(env.fact.value))
