"""The generation engines: token ids in, sampled token ids and their logprobs out (`base.RolloutBackend`, the
`BACKENDS` registry, the vLLM backend and the modules its worker processes import). Used by the rollout service
and by the reward service's LLM judge, so it sits below both."""
