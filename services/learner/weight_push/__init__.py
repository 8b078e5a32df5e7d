"""How new weights reach the rollout servers. One module per transport, picked by name."""

from services.learner.weight_push.base import PUSHERS, PushResult, WeightPusher

PUSHERS.register_lazy("grpc", "services.learner.weight_push.grpc_push")
PUSHERS.register_lazy("nccl", "services.learner.weight_push.nccl_push")
PUSHERS.register_lazy("none", "services.learner.weight_push.none")

__all__ = ["PUSHERS", "PushResult", "WeightPusher"]
