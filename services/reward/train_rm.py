"""Train a reward model on preference pairs (services/reward/preference_pairs.py): the Bradley-Terry loss
-log sigmoid(r_chosen - r_rejected) on a one-label sequence classifier initialised from `--base` (a causal LM
folder: its backbone, a fresh score head), saved with the base's tokenizer where the `reward_model` component loads
it. The pairs are token ids, so the base must share the policy's tokenizer (`reward_model`'s `input: tokens`).

    python -m services.reward.train_rm --pairs pairs.jsonl --base runs/default/model/warm --out runs/corridor-rm

A seeded fraction of the pairs' groups (tasks) is held out; the report, printed and written to the output folder as
`rm_training.json`, gives the accuracy (chosen scored above rejected) on both parts."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.reward.preference_pairs import Pair, read_pairs
from services.reward.reward_model import set_pad_token
from services.reward.shared_forward import pad_right

REPORT_FILE = "rm_training.json"


@dataclass(frozen=True)
class Settings:
    epochs: int = 4
    batch_size: int = 16
    lr: float = 5e-4
    held_out: float = 0.2
    """Fraction of the groups (tasks) whose pairs are kept out of training and only scored."""
    seed: int = 0
    max_length: int = 4096
    """The last this many tokens of a longer episode, as `reward_model` reads it."""

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.held_out < 1:
            raise ValueError(f"held_out must be in [0, 1), got {self.held_out}")


@dataclass
class Report:
    train_pairs: int
    held_out_pairs: int
    epoch_loss: list[float] = field(default_factory=list)
    train_accuracy: float = 0.0
    held_out_accuracy: float | None = None
    seconds: float = 0.0


def split_by_group(pairs: Sequence[Pair], fraction: float, seed: int) -> tuple[list[Pair], list[Pair]]:
    """(train, held out): `fraction` of the distinct groups drawn with `seed`, at least one when there are two or
    more and `fraction` > 0; a pair without a group is a group of its own."""
    if not 0 <= fraction < 1:
        raise ValueError(f"held_out must be in [0, 1), got {fraction}")
    keys = [p.group or f"#{i}" for i, p in enumerate(pairs)]
    groups = sorted(set(keys))
    count = min(len(groups) - 1, max(1, round(fraction * len(groups)))) if fraction > 0 else 0
    held = set(random.Random(seed).sample(groups, count))
    train = [p for p, k in zip(pairs, keys) if k not in held]
    return train, [p for p, k in zip(pairs, keys) if k in held]


def score(model, rows: list[list[int]], pad_id: int):
    ids, mask = pad_right(rows, pad_id)
    return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()


def accuracy(model, pairs: Sequence[Pair], pad_id: int, batch_size: int) -> float:
    """The fraction of `pairs` whose chosen side scores above its rejected side."""
    import torch

    right = 0
    with torch.inference_mode():
        for at in range(0, len(pairs), batch_size):
            batch = pairs[at : at + batch_size]
            both = score(model, [p.chosen for p in batch] + [p.rejected for p in batch], pad_id)
            right += int((both[: len(batch)] > both[len(batch) :]).sum())
    return right / len(pairs)


def load_base(base: str, seed: int):
    """(tokenizer, one-label classifier) from `base`, the score head drawn from `seed`; ValueError naming `base`."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report (the LM head dropped, a new score head) is the expected one
    try:
        tokenizer = AutoTokenizer.from_pretrained(base)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ValueError(f"base model {base!r}: {exc}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    set_pad_token(model, tokenizer, f"base model {base!r}")
    return tokenizer, model


def train_reward_model(
    pairs: Sequence[Pair],
    base: str,
    out: str | Path,
    settings: Settings = Settings(),
    say: Callable[[str], None] = lambda line: None,
) -> Report:
    """Trains on `pairs` (less the held-out groups), writes the classifier, tokenizer and report to `out`."""
    import torch

    start = time.perf_counter()
    tokenizer, model = load_base(base, settings.seed)
    pad_id, vocab = model.config.pad_token_id, model.config.vocab_size
    cut = [Pair(p.chosen[-settings.max_length :], p.rejected[-settings.max_length :], p.group) for p in pairs]
    beyond = max(max(p.chosen + p.rejected) for p in cut)
    if beyond >= vocab:
        raise ValueError(f"token id {beyond} is outside {base!r}'s vocabulary ({vocab}): pairs of another tokenizer?")
    train, held = split_by_group(cut, settings.held_out, settings.seed)
    if not train:
        raise ValueError("no pairs left to train on")
    report = Report(len(train), len(held))
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    order = random.Random(settings.seed)
    model.train()
    for epoch in range(settings.epochs):
        shuffled, losses = order.sample(train, len(train)), []
        for at in range(0, len(shuffled), settings.batch_size):
            batch = shuffled[at : at + settings.batch_size]
            both = score(model, [p.chosen for p in batch] + [p.rejected for p in batch], pad_id)
            loss = -torch.nn.functional.logsigmoid(both[: len(batch)] - both[len(batch) :]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item() * len(batch))
        report.epoch_loss.append(sum(losses) / len(train))
        say(f"epoch {epoch + 1}/{settings.epochs}: loss {report.epoch_loss[-1]:.4f}")
    model.eval()
    report.train_accuracy = accuracy(model, train, pad_id, settings.batch_size)
    report.held_out_accuracy = accuracy(model, held, pad_id, settings.batch_size) if held else None
    report.seconds = time.perf_counter() - start
    out = Path(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / REPORT_FILE).write_text(json.dumps({"base": base, "settings": asdict(settings), **asdict(report)}, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", required=True, help="JSONL of preference pairs (token ids)")
    parser.add_argument("--base", required=True, help="causal LM folder or id with the policy's tokenizer")
    parser.add_argument("--out", required=True, help="folder to write the reward model to")
    defaults = Settings()
    for name in ("epochs", "batch_size", "lr", "held_out", "seed", "max_length"):
        value = getattr(defaults, name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    try:
        settings = Settings(**{k: v for k, v in vars(args).items() if k not in ("pairs", "base", "out")})
        report = train_reward_model(read_pairs(args.pairs), args.base, args.out, settings, say=print)
    except ValueError as exc:
        print(f"train_rm: {exc}", file=sys.stderr)
        return 2
    held = "-" if report.held_out_accuracy is None else f"{report.held_out_accuracy:.1%}"
    print(
        f"{report.train_pairs} train / {report.held_out_pairs} held-out pairs: accuracy {report.train_accuracy:.1%} "
        f"train, {held} held out ({report.seconds:.0f} s); wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
