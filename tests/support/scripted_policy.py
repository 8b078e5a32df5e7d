"""A scripted policy for the agent loop (answers each observation with `reply(observation)`), the tiny
tokenizer it speaks through, and the reply that walks a corridor to its exit."""

import pytest

from services.engines.base import Generation
from services.rollout.core import VersionedGeneration


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from services.common.tiny_model import build_tiny_model

    corpus = ["You are in cell 3. The exit is to the left. <action>left</action> <action>right</action>"] * 20
    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny"), corpus))


class ScriptedPolicy:
    """Reads the latest observation from the prompt and answers with `reply(observation)`."""

    def __init__(self, tokenizer, reply, version=3):
        self.tokenizer, self.reply, self.version, self.prompts = tokenizer, reply, version, []

    async def generate(self, request_id, prompt_ids, sampling):
        self.prompts.append(list(prompt_ids))
        text = self.tokenizer.decode(prompt_ids)
        last_obs = text.rsplit("<|user|>", 1)[-1]
        ids = self.tokenizer(self.reply(last_obs), add_special_tokens=False)["input_ids"][: sampling.max_tokens - 1]
        ids.append(self.tokenizer.eos_token_id)
        return VersionedGeneration(Generation(ids, [-0.5] * len(ids), "stop"), self.version)


def toward_exit(obs):
    return "<action>left</action>" if "to the left" in obs else "<action>right</action>"
