"""Token ids of the conversation pieces the agent loop appends, rendered with the model's own chat
template. Only new pieces are tokenised; what the model sampled is never re-tokenised."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

_A, _B = "\x00PROBE_USER\x00", "\x00PROBE_ASSISTANT\x00"
INITIAL_CACHE = 256
"""First prompts kept by observation text (the groups in flight are far fewer)."""


class ChatFormatter:
    def __init__(self, tokenizer: Any, system_prompt: str | None = None):
        self.tokenizer = tokenizer
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.stop_token_ids = self._stop_ids()
        self._after_end = self._text_after_assistant_end()
        turn = [{"role": "user", "content": _A}, {"role": "assistant", "content": _B}]
        self._turn, self._turn_rendered = turn, self._render(turn, False)
        self._initial: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()

    def _render(
        self, messages: list[dict[str, str]], generation_prompt: bool, tools: list[dict[str, Any]] | None = None
    ) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _stop_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        for token in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
            tid = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        return sorted(i for i in ids if i is not None)

    def _text_after_assistant_end(self) -> str:
        """Template text that follows the assistant's end token (e.g. Qwen's "\\n" after <|im_end|>).
        The model stops at the end token, so the next observation has to carry that text."""
        rendered = self._render([{"role": "user", "content": _A}, {"role": "assistant", "content": _B}], False)
        tail = rendered[rendered.rindex(_B) + len(_B) :]
        for tid in self.stop_token_ids:
            end = self.tokenizer.convert_ids_to_tokens(tid)
            if end and end in tail:
                return tail[tail.index(end) + len(end) :]
        return tail

    def initial(self, observation: str, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The first prompt's ids, with the episode's `tools` (function schemas) given to the template. The
        episodes of a group start from the same observation, so the last `INITIAL_CACHE` prompts are kept
        (rendering the template and tokenising cost ~0.5 ms a prompt)."""
        key = (observation, json.dumps(tools, sort_keys=True) if tools else "")
        ids = self._initial.get(key)
        if ids is None:
            messages = [*self.system, {"role": "user", "content": observation}]
            ids = tuple(self._encode(self._render(messages, True, tools)))
            self._initial[key] = ids
            if len(self._initial) > INITIAL_CACHE:
                self._initial.popitem(last=False)
        else:
            self._initial.move_to_end(key)
        return list(ids)

    def observation(self, observation: str) -> list[int]:
        """Tokens that close the model's turn context and open the next one around `observation`."""
        return self._next_turn([{"role": "user", "content": observation}])

    def tool_results(self, messages: list[dict[str, str]]) -> list[int]:
        """Tokens that close the model's turn and open the next one after its calls' `tool` messages (role,
        content, name, tool_call_id), rendered by the template as it renders tool results."""
        return self._next_turn(messages)

    def _next_turn(self, messages: list[dict[str, str]]) -> list[int]:
        before = self._turn_rendered
        after = self._render([*self._turn, *messages], True)
        if not after.startswith(before):
            raise ValueError("chat template renders earlier turns differently once a turn is added")
        return self._encode(self._after_end + after[len(before) :])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
