"""How new weights get from the learner to the rollout servers: one package for both ends of every
transport, which the learner and the rollout each depend on (neither on the other).

Shared by every transport:
- `wire`: a tensor's spec, the set checksum, the served model's `ModelSignature`, the checks of received
  tensors (views of a buffer, finite values).
- `buckets`: a set as a stream of buckets (`TensorWeights`, `PackedWeights`, `pack`), each with its digest,
  and the rules a receiver holds a bucket's declaration to.
- `digest` (+ `sum64_kernel`, the Triton kernel CUDA buckets are digested with): `sha256:`/`sum64:` bucket
  digests and the checksum over them.
- `spool`: verified buckets parked in a file until the set is whole, and the learner's copy of a pushed set.
- `credential`: the push token (`OMRL_WEIGHT_TOKEN`) the learner sends and every rollout server checks.
- `rpc`: the UpdateWeights call a pusher makes.
- `base`: `WeightPusher`, `PushResult` and the `PUSHERS` registry (`learner.weight_push`).

One subpackage or module per transport (config name = module name), its sending and receiving ends side
by side:
- `grpc/` (`send`, with `fanout`, one bucket producer feeding every server's push; `receive`): the bytes
  in the UpdateWeights stream.
- `nccl/` (`group`, `pack`, `send`, `receive`, `staging`): the bytes by broadcast in a torch.distributed
  process group (gloo on CPU, NCCL on GPU), the control on the UpdateWeights stream.
- `none`: offline training, nothing pushed.

The vLLM side (the weight-transfer engines every vLLM worker runs) stays with the backend,
`services/engines/vllm_*_engine.py`: it imports vLLM, nothing here does. Importing this package
loads only the registry: torch, grpc and torch.distributed load with the modules that use them."""

from services.weightsync.base import PUSHERS, PushResult, WeightPusher

__all__ = ["PUSHERS", "PushResult", "WeightPusher"]
