"""Built-in search corpora, named in a `search` toolset's options as `corpus: builtin:<name>`. A corpus is a
function of no arguments returning its documents ({"id": ..., "text": ...}), the same on every call (seeded),
registered lazily by the module that generates it, so a config names data and never code."""

from __future__ import annotations

from services.common.registry import Registry

Document = dict[str, str]

CORPORA: Registry[list[Document]] = Registry("search corpus")

CORPORA.register_lazy("facts", "services.envs.builtin.tool_lookup")
