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


def load_value_model(path: str, dtype: str = "float32") -> torch.nn.Module:
    """The critic: the policy's architecture and initial weights with a scalar head in place of the LM head.
    The head starts at zero (every value 0), so its first updates fit the head before the trunk moves."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=DTYPES[dtype])
    with torch.no_grad():
        model.score.weight.zero_()
        if model.score.bias is not None:
            model.score.bias.zero_()
    model.config.use_cache = False
    return model.eval()


def token_values(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] float32: position t = V(tokens < t), the value of the state token t was sampled in (read
    from the head at position t - 1, the same shift as the logprobs); position 0 = 0."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[..., 0].float()
    return torch.nn.functional.pad(out[:, :-1], (1, 0))
