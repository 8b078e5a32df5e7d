"""Small hand-made trajectories."""

from services.common.trajectory import TrajectoryBuilder


def chat_episode(tokenizer, prompt: str, replies: list[str], *, observation: str = "The wall is near.", tid: str = "t"):
    """A finished corridor trajectory in `tokenizer`'s chat template: `prompt` as the user's message, then each reply
    as a model turn, `observation` between turns."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    b = TrajectoryBuilder(env="corridor", task_index=0, group_id="g", prompt_ids=list(ids), trajectory_id=tid)
    for i, reply in enumerate(replies):
        out = tokenizer(reply)["input_ids"]
        b.add_model_turn(
            out, [-0.5] * len(out), policy_version=0, text=reply, action="", action_valid=True, finish_reason="stop"
        )
        if i < len(replies) - 1:
            b.add_observation(tokenizer(observation)["input_ids"], env_reward=0.0)
    return b.finish(env_return=0.0, success=False, stop_reason="done")


def traj(group, versions, trajectory_id=None):
    """A trajectory of group `group` with one model turn (and one observation) per policy version in `versions`."""
    b = TrajectoryBuilder(env="t", task_index=0, group_id=group, prompt_ids=[5], trajectory_id=trajectory_id)
    for v in versions:
        b.add_model_turn([7], [-0.5], policy_version=v, text="", action="", action_valid=True, finish_reason="stop")
        b.add_observation([8], env_reward=0.0)
    return b.finish(env_return=0.0, success=False, stop_reason="done")


def answered(task_index, action, text=None, env="reasoning", trajectory_id="t"):
    """A one-turn episode of task `task_index` whose model turn parsed to `action` (`text`: the turn's text, by
    default the action in its tags)."""
    b = TrajectoryBuilder(env=env, task_index=task_index, group_id="g", prompt_ids=[5], trajectory_id=trajectory_id)
    text = f"<action>{action}</action>" if text is None else text
    valid = bool(action)
    b.add_model_turn([7], [-0.5], policy_version=0, text=text, action=action, action_valid=valid, finish_reason="stop")
    return b.finish(env_return=0.0, success=False, stop_reason="done")
