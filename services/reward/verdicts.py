"""A judge's prompt template and its verdicts: the placeholders a template may name, and the reply read as a score in
[0, 1], or None when the reply holds no verdict (the judge then gives its fallback)."""

from __future__ import annotations

import math
import re
import string
from collections.abc import Collection, Mapping

PLACEHOLDERS = {
    "task": "the episode's first user message (the task, as the policy read it)",
    "conversation": "the episode as text, one 'User: ...' or 'Assistant: ...' block per message",
    "final_answer": "the last model turn's text (per turn: the judged turn's)",
}
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


def check_template(template: str) -> None:
    """ValueError unless `template` is a str.format template naming only PLACEHOLDERS, at least one of them, each
    plainly (`{task}`, not `{task!r}`, `{task:>9}` or `{0}`); literal braces are doubled (`{{` `}}`)."""
    known = ", ".join(f"{{{name}}}" for name in PLACEHOLDERS)
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(f"prompt template: {exc} (write a literal brace as {{{{ or }}}})") from None
    for name, spec, conversion in fields:
        if name not in PLACEHOLDERS:
            raise ValueError(f"prompt template names {{{name}}}; it may name {known}")
        if spec or conversion:
            raise ValueError(f"prompt template: write {{{name}}} without a conversion or format spec")
    if not fields:
        raise ValueError(f"prompt template names none of {known}: the judge would not see the episode")


def render_template(template: str, values: Mapping[str, str]) -> str:
    return template.format_map(values)


def number_score(reply: str, low: float, high: float) -> float | None:
    """The first number in `reply`, mapped from [low, high] onto [0, 1]; None when there is none or it lies outside
    the range (a judge asked for 1-10 that answers 42 gave no verdict)."""
    found = _NUMBER.search(reply)
    if found is None:
        return None
    value = float(found.group())
    if not low <= value <= high:
        return None
    return (value - low) / (high - low)


def yes_probability(
    top_logprobs: Mapping[int, float], yes_ids: Collection[int], no_ids: Collection[int]
) -> float | None:
    """P(yes) / (P(yes) + P(no)) at the first generated position, each side summed over its token ids (`Yes`, `yes`,
    ...). A token missing from the top logprobs counts as probability 0 (it is less likely than every one listed);
    None when neither side is listed."""
    listed = {tok: lp for tok, lp in top_logprobs.items() if math.isfinite(lp)}  # -inf: probability 0
    yes = [lp for tok, lp in listed.items() if tok in yes_ids]
    no = [lp for tok, lp in listed.items() if tok in no_ids]
    if not yes and not no:
        return None
    shift = max(yes + no)  # relative to the likelier side: two tiny probabilities still compare
    p_yes = sum(math.exp(lp - shift) for lp in yes)
    return p_yes / (p_yes + sum(math.exp(lp - shift) for lp in no))
