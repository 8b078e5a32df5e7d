"""Sentence-level BLEU and chrF through sacrebleu (its defaults: 13a tokenisation, exponential smoothing; chrF of
character 6-grams, beta 2), scaled to 0..1, against every reference at once. Needs the `reward` extra."""

from __future__ import annotations

from services.reward.reference_scorer import Missing, ReferenceScorer, Source

MISSING = 'the {} reward needs the `sacrebleu` package: pip install -e ".[reward]" (scripts/setup.sh installs it)'


class _Sacrebleu(ReferenceScorer):
    function: str
    """sacrebleu's sentence-level function of the metric."""

    def __init__(self, key: str = "answer", source: Source = "action", missing: Missing = "zero"):
        super().__init__(key, source, missing)
        try:
            import sacrebleu
        except ImportError:
            raise ValueError(MISSING.format(self.name)) from None
        self._sentence_score = getattr(sacrebleu, self.function)

    def score(self, answer: str, references: list[str]) -> float:
        # sacrebleu's 100 for an exact copy comes out a hair above it in floating point
        return min(1.0, self._sentence_score(answer, references).score / 100)


class Bleu(_Sacrebleu):
    """sacrebleu's sentence BLEU / 100."""

    name = "bleu"
    function = "sentence_bleu"


class Chrf(_Sacrebleu):
    """sacrebleu's sentence chrF / 100."""

    name = "chrf"
    function = "sentence_chrf"
