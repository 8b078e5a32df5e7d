import importlib.util
import logging
from typing import Annotated

from pydantic import Field

from services.reward.math_worker import MISSING, MathVerifier
from services.reward.reference_scorer import Missing, ReferenceScorer, Source

log = logging.getLogger(__name__)


class MathEquiv(ReferenceScorer):
    """1.0 when math-verify finds the answer mathematically equal to a reference ("0.5" = "1/2" = "\\frac{1}{2}"),
    else 0.0; a check that takes over `timeout_s` scores 0.0 (logged). Needs the `reward` extra."""

    name = "math_equiv"

    def __init__(
        self,
        key: str = "answer",
        source: Source = "action",
        missing: Missing = "zero",
        timeout_s: Annotated[float, Field(gt=0, le=600)] = 5.0,
    ):
        super().__init__(key, source, missing)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 600:
            raise ValueError(f"timeout_s must be a number of seconds in (0, 600], got {timeout_s!r}")
        if importlib.util.find_spec("math_verify") is None:
            raise ValueError(MISSING)
        self.verifier = MathVerifier(float(timeout_s))

    def score(self, answer: str, references: list[str]) -> float:
        verdict = self.verifier.equal(answer, references)
        if verdict is None:
            log.warning(
                "math_equiv: checking %r against %r took over %gs; scored 0",
                answer[:200],
                references,
                self.verifier.timeout_s,
            )
        return float(bool(verdict))
