"""Small hand-made trajectories."""

from services.common.trajectory import TrajectoryBuilder


def traj(group, versions):
    """A trajectory of group `group` with one model turn (and one observation) per policy version in `versions`."""
    b = TrajectoryBuilder(env="t", task_index=0, group_id=group, prompt_ids=[5])
    for v in versions:
        b.add_model_turn([7], [-0.5], policy_version=v, text="", action="", action_valid=True, finish_reason="stop")
        b.add_observation([8], env_reward=0.0)
    return b.finish(env_return=0.0, success=False, stop_reason="done")
