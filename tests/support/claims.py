"""Stream entries written as a producer writes them: through a claim of the run, so that the learner counts
the group lost when it drops it (services.common.run_state.GroupLeases.count_lost). An entry written with
`TrajectoryStream.publish` held no claim: the learner trains it alike but never counts it lost."""

from services.common.run_state import RunState
from services.common.stream import entry_fields


def publish_claimed(state: RunState, trajectories, group_id: str, max_len: int = 10000) -> str:
    """Claims the run's next slot and publishes `trajectories` under it; the stream entry's id."""
    leases = state.leases
    lease = leases.claim("tests", groups_per_step=1, limit_step=1 << 30, ttl_s=60.0)
    return leases.publish(lease, state.trajectories_key, max_len, entry_fields(trajectories, group_id))
