"""Token ids of the conversation pieces the agent loop appends, rendered with the model's own chat
template. Only new pieces are tokenised; what the model sampled is never re-tokenised."""

from __future__ import annotations

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
        self._initial: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

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

    def initial(self, observation: str) -> list[int]:
        """The first prompt's ids. The episodes of a group start from the same observation, so the last
        `INITIAL_CACHE` prompts are kept (rendering the template and tokenising cost ~0.5 ms a prompt)."""
        ids = self._initial.get(observation)
        if ids is None:
            ids = tuple(self._encode(self._render([*self.system, {"role": "user", "content": observation}], True)))
            self._initial[observation] = ids
            if len(self._initial) > INITIAL_CACHE:
                self._initial.popitem(last=False)
        else:
            self._initial.move_to_end(observation)
        return list(ids)

    def observation(self, observation: str) -> list[int]:
        """Tokens that close the model's turn context and open the next one around `observation`."""
        before = self._turn_rendered
        after = self._render([*self._turn, {"role": "user", "content": observation}], True)
        if not after.startswith(before):
            raise ValueError("chat template renders earlier turns differently once a turn is added")
        return self._encode(self._after_end + after[len(before) :])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
