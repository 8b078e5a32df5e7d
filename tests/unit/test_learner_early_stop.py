"""`learner.stop_at_success`: the run ends at the first step whose success rate, averaged over the last
`stop_window` steps, reaches the target, with the checkpoint and export of a last step; without it, or below
it, every one of `learner.steps` runs."""

from types import SimpleNamespace

import pytest

from services.common.config import TrainConfig
from services.learner.service import CollectedStep, LearnerService


def run(successes, steps, stop_at=None, window=3):
    config = TrainConfig.model_validate(
        {"learner": {"steps": steps, "stop_at_success": stop_at, "stop_window": window}}
    )
    rates = iter(successes)
    service = LearnerService(
        config, trainer=SimpleNamespace(policy_version=0), pusher=SimpleNamespace(needs_servers=False)
    )
    done, forced, exported = [], [], []
    service.resume = lambda: None
    service._collect = lambda: CollectedStep()
    service.guard = SimpleNamespace(train=lambda trainer, batch: {"success_rate": next(rates)})
    service._push = lambda rollback=False: (0.0, None, [])
    service._checkpoint = lambda force: forced.append(force) or 0.0
    service.export_policy = lambda: exported.append(service.step)
    service.state = SimpleNamespace(
        mark_done=lambda: done.append(True), publish_metrics=lambda step, summary: None, failure=lambda: None
    )
    service._export = lambda summary, episodes: service.history.append(summary)
    history = service.run()
    return [m["step"] for m in history], forced, exported, done


def test_the_run_ends_at_the_first_step_whose_window_reaches_the_target():
    # windows of 3: (.2 .5 .8)=.5, (.5 .8 .9)=.73, (.8 .9 1)=.9 at step 5
    steps, forced, exported, done = run([0.2, 0.5, 0.8, 0.9, 1.0, 1.0, 1.0], steps=7, stop_at=0.9)
    assert steps == [1, 2, 3, 4, 5]
    assert forced == [False] * 4 + [True] and exported == [5] and done == [True]


def test_a_run_that_never_reaches_it_runs_every_step():
    steps, forced, exported, _ = run([0.2, 0.9, 1.0, 0.7, 0.9, 0.9], steps=6, stop_at=0.9)
    assert steps == [1, 2, 3, 4, 5, 6] and forced[-1] and exported == [6]


def test_a_full_window_is_needed_and_without_a_target_every_step_runs():
    assert run([1.0, 1.0, 0.1], steps=3, stop_at=0.5, window=4)[0] == [1, 2, 3]
    assert run([1.0] * 4, steps=4)[0] == [1, 2, 3, 4]


@pytest.mark.parametrize("bad", [0, 1.5, -0.1])
def test_the_target_is_a_rate(bad):
    with pytest.raises(ValueError):
        TrainConfig.model_validate({"learner": {"stop_at_success": bad}})
