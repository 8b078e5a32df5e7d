"""The generated message and stub modules, under short names."""

import services.common.gen  # noqa: F401  (puts the generated root on sys.path; must come first)

try:
    from openmanus.envs.v1 import envs_pb2, envs_pb2_grpc
    from openmanus.reward.v1 import reward_pb2, reward_pb2_grpc
    from openmanus.rollout.v1 import rollout_pb2, rollout_pb2_grpc
    from openmanus.trajectory.v1 import trajectory_pb2
except ImportError as exc:  # pragma: no cover - only before the build step ran
    raise ImportError(
        "generated gRPC code is missing: run `python -m services.common.protogen` (scripts/setup.sh does)"
    ) from exc

__all__ = [
    "envs_pb2",
    "envs_pb2_grpc",
    "reward_pb2",
    "reward_pb2_grpc",
    "rollout_pb2",
    "rollout_pb2_grpc",
    "trajectory_pb2",
]
