"""The policy network: a Hugging Face causal LM, and its per-token logprobs."""
from __future__ import annotations

import torch

from services.learner.batch import entropy_from_logits, logprobs_from_logits

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(path: str, dtype: str = "float32") -> torch.nn.Module:
    """Loads on CPU with dropout off (eval mode), so PPO's first-epoch ratio is exactly 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    model.config.use_cache = False
    return model.eval()


def _logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] float32: position t = log p(token t | tokens < t), position 0 = 0."""
    return logprobs_from_logits(_logits(model, input_ids, attention_mask), input_ids)


def token_logprobs_and_entropy(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    logits = _logits(model, input_ids, attention_mask)
    return logprobs_from_logits(logits, input_ids), entropy_from_logits(logits)
