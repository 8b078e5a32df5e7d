"""The search toolset: BM25 over folder, parquet and built-in corpora, deterministic ranking, clear corpus errors."""

import asyncio
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.envs.tools import TOOLSETS, ToolContext
from services.envs.tools.corpora import CORPORA
from services.envs.tools.search import load_index

CTX = ToolContext("episode", Path("."), 10.0)
FACTS = {
    "planets/zorblax.txt": "The planet Zorblax has 17 moons and a purple sky.",
    "planets/quenth.md": "The planet Quenth has 4 moons and frequent storms.",
    "rivers/velm.txt": "The river Velm is 812 kilometres long and flows north.",
    "notes.md": "Moons and planets and rivers: a general note about the atlas.",
}


def started(corpus: str, **options):
    cls = TOOLSETS.get("search")
    toolset = cls(cls.Options(corpus=corpus, **options))
    asyncio.run(toolset.start())
    return toolset


def search(toolset, **arguments) -> str:
    return asyncio.run(toolset.call("search", arguments, CTX)).content


@pytest.fixture
def folder(tmp_path):
    for name, text in FACTS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "ignored.json").write_text('{"text": "Zorblax"}')
    return tmp_path


def test_folder_corpus_ranks_the_unique_fact_first(folder):
    toolset = started(str(folder))
    out = search(toolset, query="How many moons does Zorblax have?")
    assert out.startswith("1. planets/zorblax.txt\nThe planet Zorblax has 17 moons")
    assert "ignored.json" not in out
    assert out.count("\n\n") == 2  # k=3: the other documents that mention moons
    assert search(toolset, query="Zorblax", k=1) == "1. planets/zorblax.txt\n" + FACTS["planets/zorblax.txt"]
    assert search(toolset, query="how long is the river Velm").startswith("1. rivers/velm.txt")
    assert search(toolset, query="the of and") == "no document matches 'the of and'"
    assert search(toolset, query="xylophone") == "no document matches 'xylophone'"
    assert toolset.specs()[0].parameters["properties"]["k"]["maximum"] == 10


def test_ties_go_in_an_order_drawn_from_the_query_and_never_above_a_better_match(tmp_path):
    for i in range(8):
        (tmp_path / f"{i}.txt").write_text("same words here")
    (tmp_path / "best.txt").write_text("same words here, and same words here")
    toolset = started(str(tmp_path))

    def order(query: str) -> list[str]:
        out = search(toolset, query=query, k=9)
        return [hit.split("\n")[0].split(". ", 1)[1] for hit in out.split("\n\n")]

    orders = [order(query) for query in ("same words", "words here", "same here", "same words here")]
    assert all(o[0] == "best.txt" and sorted(o[1:]) == [f"{i}.txt" for i in range(8)] for o in orders)
    assert order("same words") == orders[0]  # the same query, the same order
    assert len({tuple(o) for o in orders}) == 4, orders  # a vague query does not always show the same documents


def test_snippet_starts_near_the_match_and_is_cut(tmp_path):
    (tmp_path / "long.txt").write_text("filler " * 200 + "the Quokka clause " + "tail " * 200)
    out = search(started(str(tmp_path), snippet_chars=40), query="quokka")
    snippet = out.split("\n")[1]
    assert snippet.startswith("…") and snippet.endswith("…") and "Quokka" in snippet
    assert len(snippet) == 42


def test_parquet_corpus_with_ids_and_titles(tmp_path):
    table = pa.table(
        {
            "id": ["d1", "d2", "d3"],
            "title": ["Zorblax", "Quenth", None],
            "text": ["A planet with 17 moons.", "A planet with storms.", "Velm is a river."],
        }
    )
    pq.write_table(table, tmp_path / "c.parquet")
    toolset = started(str(tmp_path / "c.parquet"))
    assert search(toolset, query="zorblax moons", k=1) == "1. d1 (Zorblax)\nA planet with 17 moons."
    assert search(toolset, query="velm", k=1) == "1. d3\nVelm is a river."
    pq.write_table(pa.table({"text": ["only text here"]}), tmp_path / "bare.parquet")
    assert search(started(str(tmp_path / "bare.parquet")), query="text") == "1. 0\nonly text here"


def test_builtin_corpus_through_the_registry():
    documents = [{"id": "x1", "text": "Zorblax moons"}, {"id": "x2", "text": "Quenth storms"}]
    CORPORA.register("throwaway_test_corpus")(lambda: documents)
    try:
        assert search(started("builtin:throwaway_test_corpus"), query="zorblax") == "1. x1\nZorblax moons"
    finally:
        CORPORA.unregister("throwaway_test_corpus")


def test_instances_share_one_index_until_the_corpus_changes(folder):
    assert load_index(str(folder)) is load_index(str(folder))
    first = load_index(str(folder))
    (folder / "new.txt").write_text("Brand new Plimsoll document")
    assert load_index(str(folder)) is not first
    assert search(started(str(folder)), query="plimsoll", k=1).startswith("1. new.txt")


def test_bad_corpora_fail_at_start_naming_them(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "stop").mkdir()
    (tmp_path / "stop" / "a.txt").write_text("the of and")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "notext.parquet")
    cases = {
        str(tmp_path / "missing"): "does not exist",
        str(tmp_path / "empty"): "has no documents",
        str(tmp_path / "stop"): "has no searchable words",
        str(tmp_path / "notext.parquet"): "no `text` column",
        "builtin:no_such_corpus": "unknown search corpus",
    }
    for corpus, message in cases.items():
        with pytest.raises(ValueError, match=message) as raised:
            started(corpus)
        assert corpus in str(raised.value) or corpus.endswith(".parquet")


def test_k_above_max_k_is_refused_in_options():
    with pytest.raises(ValueError, match="max_k"):
        TOOLSETS.get("search").Options(corpus="x", k=5, max_k=4)
