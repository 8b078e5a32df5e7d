"""The `nccl` weight push: each bucket's bytes by broadcast in a torch.distributed process group per rollout
server, the control (credential, header, per-bucket specs and digest, commit) on the authenticated gRPC
stream, so every check runs before anything is applied.

One code path for CPU and GPU; only the process-group backend differs (gloo moves CPU tensors, nccl CUDA
tensors). The learner's rank 0 is rank 0 of a small group per rollout server (itself plus that server's
engine workers) and broadcasts each bucket to it.

The groups are not torch's default group (the learner's FSDP world and each vLLM worker's own world
already are): they are built straight from a store (`ProcessGroupGloo` / `ProcessGroupNCCL`). The learner
hosts the `TCPStore` on the rendezvous port; every group lives under its own prefix, named by the
learner, so a broken group is replaced by a fresh one without restarting anything.

Sending side beside receiving side:
- `group`: where a group meets (`Rendezvous`) and the group itself (`Group`), for both sides.
- `send` (learner): `NcclWeightPusher`, the transport registered as `nccl`; `pack`: its buckets packed on
  the learner's device (`pack_buckets`, `BucketPacker`) and the window of broadcasts in flight.
- `receive` (a rollout engine worker, or a plain Hugging Face receiver, `bench/weight_sync_gpu.py`): each
  bucket received into a reused buffer and checked (`BucketReceiver`), and applied to named parameters
  (`ParamCopier`).
- `staging`: the rollout server's record of a push (`NcclStaging`: declarations, spool offsets, digests),
  and where the worker stages checked buckets until the commit (`BucketStager` into the spool file,
  `HostArena` in memory).

Bucket digests (`sha256:` on CPU, `sum64:` on a GPU) and the set checksum over them are in
`weightsync.digest`. The vLLM side, the `omrl_nccl` weight-transfer engine every worker runs, is
`services/engines/vllm_nccl_engine.py` (it imports vLLM; this package does not). Nothing is
imported here: torch.distributed loads with the module that uses it."""
