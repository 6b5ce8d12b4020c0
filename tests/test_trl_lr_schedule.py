"""attach_logra and the trainer's learning-rate schedule: ``update_ratio`` is the group's ``"lr"``,
so the trainer's default linear decay would take LoGRA's step to zero by the end of training."""

from __future__ import annotations

import pytest

from logra_optim.integrations.trl import attach_logra
from tests.helpers import trl_setup as setup

NO_KL = dict(rank=16, kl_budget=None, update_ratio=5e-2)


def _logged_ratios(trainer) -> list[float]:
    return [entry["logra/update_ratio"] for entry in trainer.state.log_history if "logra/update_ratio" in entry]


def test_default_linear_decay_is_replaced_by_a_constant_schedule(tmp_path):
    trainer = setup.build_trainer("grpo", setup.build_policy(), tmp_path, max_steps=4)
    assert trainer.args.lr_scheduler_type == "linear"  # TrainingArguments' default
    with pytest.warns(UserWarning, match="using lr_scheduler_type='constant'"):
        attach_logra(trainer, **NO_KL)
    trainer.train()
    assert _logged_ratios(trainer) == pytest.approx([5e-2] * 4)


def test_an_explicit_schedule_is_kept_and_logged(tmp_path):
    trainer = setup.build_trainer("grpo", setup.build_policy(), tmp_path, max_steps=4)
    attach_logra(trainer, keep_lr_schedule=True, **NO_KL)
    trainer.train()
    ratios = _logged_ratios(trainer)
    assert ratios[0] == pytest.approx(5e-2)
    assert ratios == sorted(ratios, reverse=True) and ratios[-1] < ratios[0] / 2  # the linear decay, as asked

    trainer = setup.build_trainer("grpo", setup.build_policy(), tmp_path / "cosine", lr_scheduler_type="cosine")
    attach_logra(trainer, **NO_KL)
    assert trainer.args.lr_scheduler_type == "cosine"


def test_warmup_is_kept_when_the_decay_is_dropped(tmp_path):
    trainer = setup.build_trainer("grpo", setup.build_policy(), tmp_path, max_steps=4, warmup_steps=2)
    with pytest.warns(UserWarning, match="constant_with_warmup"):
        attach_logra(trainer, **NO_KL)
    trainer.train()
    ratios = _logged_ratios(trainer)
    assert ratios[0] < ratios[-1] == pytest.approx(5e-2)  # warming up, then constant
