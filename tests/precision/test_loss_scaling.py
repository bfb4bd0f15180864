"""LossScaling's host side: its log lines, the overflows in a row and the fallback decision,
from what the reads saw (the device side is checked against GradScaler in
test_gradscaler_parity.py and test_loss_scaler.py)."""

import logging

import torch

from mixprec.precision.loss_scaling import LossScaler, LossScaling
from mixprec.precision.scaling_config import LossScaleConfig


def test_overflow_lines_are_summarised_not_flooded(caplog):
    scaling = LossScaling(LossScaleConfig(init_scale=2.0), verbose=3, summary_every=10)
    with caplog.at_level(logging.INFO, logger="mixprec"):
        for step in range(1, 31):
            scaling.record(step, overflow=True, after=1.0, overflows=step)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "[OVERFLOW] step 1: loss scale 2 -> 1 (overflow 1/1)"
    assert sum("[OVERFLOW] step " in line for line in lines) == 3
    summaries = [line for line in lines if line.startswith("[OVERFLOW] steps")]
    assert summaries == ["[OVERFLOW] steps 4-10: 7 overflows, loss scale now 1 (overflow 10/10)",
                         "[OVERFLOW] steps 11-20: 10 overflows, loss scale now 1 (overflow 20/20)",
                         "[OVERFLOW] steps 21-30: 10 overflows, loss scale now 1 (overflow 30/30)"]
    assert scaling.consecutive == 30


def test_growth_is_logged_and_clean_steps_reset_the_run(caplog):
    scaling = LossScaling(LossScaleConfig(init_scale=4.0, growth_interval=3))
    with caplog.at_level(logging.INFO, logger="mixprec"):
        scaling.record(1, True, 2.0, 1)
        scaling.record(2, False, 4.0, 1)
    assert "[SCALE] loss scale 2 -> 4 after 3 clean steps" in caplog.text
    assert scaling.consecutive == 0


def test_the_fallback_reason_comes_after_the_configured_overflows_in_a_row():
    scaling = LossScaling(LossScaleConfig(init_scale=1024.0, fallback_after=3), fallback_to="fp32")
    reasons = [scaling.record(step, True, 1024.0 / 2**step, step) for step in (1, 2, 3)]
    assert reasons == [None, None, "after 3 consecutive overflows"]
    at_minimum = LossScaling(LossScaleConfig(init_scale=1.0, fallback_after=0), fallback_to="fp32")
    assert at_minimum.record(1, True, 1.0, 1) == "at the minimum loss scale 1"
    no_target = LossScaling(LossScaleConfig(init_scale=1.0, fallback_after=1))
    assert no_target.record(1, True, 1.0, 1) is None


def test_the_gradscaler_facade_holds_no_state_of_its_own():
    """The facade's scale, tracker and state_dict are its LossScaling's: one copy of each."""
    scaler = LossScaler("cpu", init_scale=8.0, growth_interval=1)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler._get_scale_async() is scaler.scaling.scale and scaler.get_scale() == 16.0
    assert scaler.state_dict() == scaler.scaling.state_dict()
    scaler.set_growth_factor(4.0)
    assert scaler.scaling.config.growth_factor == 4.0
