"""`mixprec demo reduction`: the seed's examples computed, and the measured reduction error."""

import pytest

from mixprec.demo import examples, measure


def test_seed_examples_as_measured():
    four, eight = examples()
    # The seed says a BF16 reduction of 1e7, 1, -1e7, 1 gives 0; in order it gives 1:
    # 1e7 + 1 rounds back to 1e7 (BF16 spacing there is 65536), the last 1 survives.
    assert (four["bfloat16"], four["float32"], four["exact"]) == (1.0, 2.0, 2.0)
    # FP32 does not save the 8-rank case either: the two 1e-4 before 1e7 are absorbed (FP32
    # spacing at 1e7 is 1); only the order of the reduction would.
    assert eight["float32"] == pytest.approx(3e-4, rel=0.01) and eight["exact"] == pytest.approx(6e-4, rel=0.01)


def test_bfloat16_reduction_error_is_measurable_and_float32_is_not():
    errors = measure(2)
    assert errors["float32"] < 1e-5
    assert errors["bfloat16"] > 100 * errors["float32"]
