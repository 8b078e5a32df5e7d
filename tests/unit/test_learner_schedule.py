import math

import pytest
import torch

from services.common.config import AlgorithmConfig
from services.learner.schedule import build_scheduler, lr_factor, restore_scheduler


def test_constant_with_warmup():
    algo = AlgorithmConfig(lr_warmup_steps=4)
    assert [lr_factor(s, algo, 10) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(0, AlgorithmConfig(), 10) == 1.0


def test_cosine_reaches_min_ratio_at_the_last_step():
    algo = AlgorithmConfig(lr_schedule="cosine", lr_warmup_steps=2, min_lr_ratio=0.1)
    factors = [lr_factor(s, algo, 12) for s in range(13)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert factors[7] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factors[12] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[2:], factors[3:]))


def test_scheduler_drives_the_optimizer_and_resumes_with_the_configured_base():
    algo = AlgorithmConfig(lr=0.01, lr_schedule="cosine", lr_warmup_steps=2)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=algo.lr)
    sched = build_scheduler(opt, algo, 10)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.01 * lr_factor(s, algo, 10) for s in range(5)])
    opt2 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.02)
    sched2 = build_scheduler(opt2, algo, 10)
    restore_scheduler(sched2, sched.state_dict(), base_lr=0.02)
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.02 * lr_factor(5, algo, 10))
    sched.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(2 * opt.param_groups[0]["lr"])
