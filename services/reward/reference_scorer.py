"""The base of the rule scorers that compare the model's answer with its task's reference answer (exact match, token
F1, BLEU, chrF, math equivalence), after verl's rule-based reward scores.

Params every one takes:
- `key`: the ground-truth field that holds the answer (default "answer"); a ground truth that is a bare JSON string
  or number is the answer itself;
- `source`: what of the last model turn is the answer: `action`, its parsed action ("" when none parsed), or `text`;
- `missing`: a task without a reference scores 0.0 (`zero`) or fails its batch (`fail`); either way it is counted
  (`omrl_reward_reference_missing_total{component}`) and the first one is logged.
The composer hands each one the run's reference answers (services.reward.references) when it builds it."""

from __future__ import annotations

import abc
from typing import Literal, get_args

from services.reward.base import RewardFunction
from services.reward.references import References

Source = Literal["action", "text"]
Missing = Literal["zero", "fail"]


class MissingReference(LookupError):
    """A task without a reference answer, for a scorer with `missing: fail`."""


def model_answer(traj, source: str) -> str:
    if not traj.turns:
        return ""
    turn = traj.turns[-1]
    return turn.action if source == "action" else turn.text


class ReferenceScorer(RewardFunction):
    def __init__(self, key: str = "answer", source: Source = "action", missing: Missing = "zero"):
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty string, got {key!r}")
        for param, value, allowed in (("source", source, Source), ("missing", missing, Missing)):
            if value not in get_args(allowed):
                raise ValueError(f"{param} must be one of {', '.join(get_args(allowed))}; got {value!r}")
        self.key, self.source, self.missing = key, source, missing
        self.references: References | None = None
        self.component = self.name

    def bind(self, references: References, component: str) -> None:
        """`component`: its name in the config, the label of its missing-reference count."""
        self.references, self.component = references, component
        references.watch(component)

    def __call__(self, traj) -> float:
        if self.references is None:
            raise RuntimeError(f"{self.name} has no reference answers: build it with RewardComposer(references=...)")
        answers = self.references.answers(traj.task_index, self.key)
        if not answers:
            self.references.missing(self.component, traj.task_index, self.missing)
            if self.missing == "fail":
                raise MissingReference(
                    f"task {traj.task_index} has no reference answer ({self.key!r}) in {self.references.folder}"
                )
            return 0.0
        return self.score(model_answer(traj, self.source), answers)

    @abc.abstractmethod
    def score(self, answer: str, references: list[str]) -> float:
        """In [0, 1]: how well `answer` matches the best of `references` (one at least)."""
