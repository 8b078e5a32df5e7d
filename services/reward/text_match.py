"""SQuAD's answer metrics: exact match and token F1 of normalised strings (lower case, no punctuation, no articles,
single spaces), the best over the reference answers."""

from __future__ import annotations

import re
import string
from collections import Counter

from services.reward.reference_scorer import ReferenceScorer

_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def token_f1(answer: str, reference: str) -> float:
    predicted, wanted = normalize_answer(answer).split(), normalize_answer(reference).split()
    if not predicted or not wanted:  # SQuAD 2.0: two empty answers agree
        return float(predicted == wanted)
    same = sum((Counter(predicted) & Counter(wanted)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(wanted)
    return 2 * precision * recall / (precision + recall)


class ExactMatch(ReferenceScorer):
    """1.0 when the normalised answer equals a normalised reference, else 0.0."""

    name = "exact_match"

    def score(self, answer: str, references: list[str]) -> float:
        return float(any(normalize_answer(answer) == normalize_answer(ref) for ref in references))


class TokenF1(ReferenceScorer):
    """SQuAD's token F1 of the normalised answer against the best reference."""

    name = "token_f1"

    def score(self, answer: str, references: list[str]) -> float:
        return max(token_f1(answer, ref) for ref in references)
