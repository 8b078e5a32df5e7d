"""The `search` toolset: BM25 keyword search (bm25s) over a fixed corpus, returning the best documents' ids and
snippets.

A corpus is a folder of .txt/.md files (one document each, id = its path relative to the folder), a .parquet file
(a `text` column; `id` and `title` optional), or `builtin:<name>` (`services.envs.tools.corpora.CORPORA`). The
index is built once per corpus and file version, in `start`, and shared by every instance naming that corpus.
Results are deterministic: documents by score, ties in corpus order (folder files in path order)."""

from __future__ import annotations

import asyncio
import functools
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bm25s
import numpy as np
from pydantic import Field, model_validator

from services.common import trust
from services.envs.tools.base import TOOLSETS, ToolContext, ToolOptions, ToolOutput, Toolset, ToolSpec
from services.envs.tools.corpora import CORPORA

_BUILTIN = "builtin:"
_SUFFIXES = (".txt", ".md")
_STOPWORDS = "en"


class SearchOptions(ToolOptions):
    corpus: str = Field(json_schema_extra=trust.PATH)
    """A folder of .txt/.md files, a .parquet file with a `text` column, or `builtin:<name>`."""
    k: int = Field(3, ge=1)
    """Documents returned when the call does not say."""
    max_k: int = Field(10, ge=1)
    """The most documents a call may ask for."""
    snippet_chars: int = Field(400, ge=1)
    """Characters of each document shown, from a little before the first query word found in it."""

    @model_validator(mode="after")
    def _k_within_max_k(self) -> SearchOptions:
        if self.k > self.max_k:
            raise ValueError(f"k ({self.k}) is more than max_k ({self.max_k})")
        return self


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    title: str = ""


@dataclass(frozen=True)
class Index:
    documents: list[Document]
    retriever: bm25s.BM25

    def search(self, query: str, k: int) -> tuple[list[Document], list[str]]:
        """The best `k` documents with a positive score, and the query's indexed words. Ties go in an order drawn
        from the query's words (the same words, the same order): documents written from one template tie on a
        vague query, which in corpus order would show the corpus's first ones to every such query."""
        words = [w for w in _tokenize([query])[0] if w and w in self.retriever.vocab_dict]
        if not words:
            return [], []
        scores = self.retriever.get_scores(words)
        found = np.flatnonzero(scores > 0)
        ranked = found[np.lexsort((_tie_order(found, words), -scores[found]))][:k]
        return [self.documents[i] for i in ranked], words


def _tie_order(found: np.ndarray, words: list[str]) -> np.ndarray:
    """A pseudo-random order of the documents `found`, drawn from `words` (splitmix64 of index and seed)."""
    with np.errstate(over="ignore"):
        x = found.astype(np.uint64) + np.uint64(zlib.crc32(" ".join(words).encode())) * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@TOOLSETS.register("search")
class Search(Toolset):
    type = "search"
    Options = SearchOptions

    async def start(self) -> None:
        self.index = await asyncio.to_thread(load_index, self.options.corpus)

    def specs(self) -> list[ToolSpec]:
        return [
            ToolSpec(
                name="search",
                description=(
                    "Searches a collection of documents by keywords (BM25) and returns the best matches, each "
                    "with its id and a snippet. Use distinctive words from what you are looking for."
                ),
                parameters={
                    "type": "object",
                    "properties": {
                        "query": {"type": "string", "description": "Keywords to search for."},
                        "k": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": self.options.max_k,
                            "description": f"How many documents to return (default {self.options.k}).",
                        },
                    },
                    "required": ["query"],
                    "additionalProperties": False,
                },
            )
        ]

    async def call(self, name: str, arguments: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        query = arguments["query"]
        hits, words = await asyncio.to_thread(self.index.search, query, arguments.get("k", self.options.k))
        if not hits:
            return ToolOutput(f"no document matches {query!r}")
        return ToolOutput("\n\n".join(self._hit(rank, doc, words) for rank, doc in enumerate(hits, 1)))

    def _hit(self, rank: int, doc: Document, words: list[str]) -> str:
        title = f" ({doc.title})" if doc.title else ""
        return f"{rank}. {doc.id}{title}\n{_snippet(doc.text, words, self.options.snippet_chars)}"


def load_index(corpus: str) -> Index:
    """The index of `corpus`, built once per version of its files; ValueError naming it where it is missing or
    empty."""
    return _build(corpus, _stamp(corpus))


def _stamp(corpus: str) -> tuple[tuple[str, int, int], ...]:
    """(file, mtime, size) of each file of the corpus, so an edited corpus is indexed anew."""
    if corpus.startswith(_BUILTIN):
        return ()
    path = Path(corpus)
    if not path.exists():
        raise ValueError(f"search corpus {corpus!r} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in _SUFFIXES and p.is_file())
    elif path.suffix == ".parquet" and path.is_file():
        files = [path]
    else:
        raise ValueError(f"search corpus {corpus!r} is neither a folder nor a .parquet file")
    return tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files)


@functools.lru_cache(maxsize=8)
def _build(corpus: str, stamp: tuple[tuple[str, int, int], ...]) -> Index:
    documents = _documents(corpus, [Path(file) for file, _, _ in stamp])
    if not documents:
        raise ValueError(f"search corpus {corpus!r} has no documents")
    tokens = _tokenize([f"{d.title}\n{d.text}" for d in documents], return_ids=True)
    if not tokens.vocab:
        raise ValueError(f"search corpus {corpus!r} has no searchable words")
    retriever = bm25s.BM25()
    retriever.index(tokens, show_progress=False)
    return Index(documents, retriever)


def _documents(corpus: str, files: list[Path]) -> list[Document]:
    if corpus.startswith(_BUILTIN):
        try:
            entries = CORPORA.get(corpus.removeprefix(_BUILTIN))()
        except KeyError as error:
            raise ValueError(f"search corpus {corpus!r}: {error.args[0]}") from None
        return [Document(str(e["id"]), e["text"], e.get("title", "")) for e in entries]
    root = Path(corpus)
    if not root.is_dir():
        return _parquet(root)
    return [Document(f.relative_to(root).as_posix(), f.read_text("utf-8", errors="replace")) for f in files]


def _parquet(path: Path) -> list[Document]:
    import pyarrow.parquet as pq

    columns = pq.read_schema(path).names
    if "text" not in columns:
        raise ValueError(f"search corpus {str(path)!r} has no `text` column")
    rows = pq.read_table(path, columns=[c for c in ("id", "title", "text") if c in columns]).to_pylist()
    return [
        Document(str(i if row.get("id") is None else row["id"]), row["text"] or "", row.get("title") or "")
        for i, row in enumerate(rows)
    ]


def _tokenize(texts: list[str], return_ids: bool = False) -> Any:
    return bm25s.tokenize(texts, stopwords=_STOPWORDS, return_ids=return_ids, show_progress=False)


def _snippet(text: str, words: list[str], limit: int) -> str:
    flat = " ".join(text.split())
    found = [m.start() for w in words if (m := re.search(rf"\b{re.escape(w)}\b", flat, re.IGNORECASE))]
    start = max(min(found, default=0) - limit // 4, 0)
    end = start + limit
    return ("…" if start else "") + flat[start:end] + ("…" if end < len(flat) else "")
