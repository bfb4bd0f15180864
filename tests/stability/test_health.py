import math
import statistics

import pytest

from mixprec.errors import UserError
from mixprec.stability.config import Drill, StabilityConfig, parse_drill
from mixprec.stability.health import HealthMonitor


def fill(monitor, losses, norms):
    for step, (loss, norm) in enumerate(zip(losses, norms), 1):
        assert monitor.check(step, loss, norm).kind is None
    return len(losses)


def test_z_score_is_against_the_window_mean_and_deviation():
    m = HealthMonitor(window=8, threshold=6.0, min_history=4)
    losses = [2.0, 2.1, 1.9, 2.05, 2.0, 1.95, 2.1, 2.0, 1.9, 2.0]
    step = fill(m, losses, [1.0] * len(losses))
    window = losses[-8:]
    expected = (2.3 - statistics.fmean(window)) / statistics.pstdev(window)
    health = m.check(step + 1, 2.3, 1.0)
    assert health.loss_z == pytest.approx(expected)
    assert (health.kind is None) == (expected <= 6.0)


def test_no_verdict_before_min_history():
    m = HealthMonitor(window=8, threshold=6.0, min_history=4)
    fill(m, [2.0, 2.1, 2.0], [1.0, 1.1, 1.0])
    health = m.check(4, 500.0, 1.0)  # a huge value, but only 3 steps of history
    assert health.loss_z is None and health.kind is None


def test_loss_and_gradient_spikes_and_the_spike_stays_out_of_the_window():
    m = HealthMonitor(window=16, threshold=6.0, min_history=4)
    step = fill(m, [3.0 + 0.01 * (i % 3) for i in range(10)], [1.0 + 0.02 * (i % 2) for i in range(10)])
    spike = m.check(step + 1, 30.0, 1.0)
    assert spike.kind == "loss_spike" and "standard deviations" in spike.reason
    assert spike.spike_score == pytest.approx(100 / 16)
    assert max(m.losses) < 4  # the spike did not widen the band
    grad = m.check(step + 2, 3.0, 50.0)  # unclipped, with a healthy loss: a warning too (issue 55 item 10)
    assert grad.kind is None and "standard deviations" in grad.warning and max(m.norms) < 2
    clipped = m.check(step + 3, 3.0, 50.0)  # clipping bounded it (the guard's log says so): a warning only
    assert clipped.kind is None and "standard deviations" in clipped.warning and max(m.norms) < 2
    assert m.losses[-1] == 3.0  # its loss was healthy and entered the window
    assert m.check(step + 4, 30.0, 1.0).kind == "loss_spike"  # clipping bounds no loss


def test_nonfinite_and_the_scaler_s_overflows():
    m = HealthMonitor(window=16, threshold=6.0, min_history=4)
    assert m.check(1, math.nan, 1.0).kind == "nonfinite"
    assert m.check(2, 3.0, math.inf).kind == "nonfinite"  # no loss scaler claimed it
    overflow = m.check(3, 3.0, math.inf, overflow=True)  # fp16: the loss scaler's business
    assert overflow.kind is None and len(m.norms) == 0 and len(m.losses) == 0
    assert m.check(4, math.inf, math.inf, overflow=True).kind == "nonfinite"  # a non-finite loss is not an overflow


def test_state_round_trip_and_a_rewind_keeps_the_spike_record():
    m = HealthMonitor(window=16, threshold=6.0, min_history=4)
    fill(m, [3.0, 3.1, 2.9, 3.0, 3.05], [1.0] * 5)
    saved = m.state_dict()
    m.check(6, 300.0, 1.0)
    m.load_state_dict(saved, spikes=False)
    assert list(m.losses) == saved["losses"] and list(m.spikes) == [6]
    m.load_state_dict(saved)
    assert list(m.spikes) == []


@pytest.mark.parametrize("spec, drill", [
    ("", None),
    ("spike@12", Drill("spike", 12)),
    ("nan@5:layers.0.feed_forward.w2", Drill("nan", 5, "layers.0.feed_forward.w2")),
    ("nan@5:output:1", Drill("nan", 5, "output", 1)),
])
def test_drill_forms(spec, drill):
    assert parse_drill(spec) == drill
    if drill is not None:
        assert parse_drill(str(drill)) == drill


@pytest.mark.parametrize("field, value", [("inject", "nan@0:output"), ("inject", "nan@3"), ("inject", "boom@3"),
                                          ("window", 2), ("threshold", 0.0), ("lr_backoff", 1.5),
                                          ("snapshot_interval", -1), ("max_rewinds", -1)])
def test_bad_values_are_one_line_naming_the_field(field, value):
    with pytest.raises(UserError, match=f"stability.{field}: bad value"):
        StabilityConfig(**{field: value})
