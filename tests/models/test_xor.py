"""xor: 2 -> 8 tanh -> 1 logit (what every model passes: tests/conformance/)."""

from __future__ import annotations

from conformance.checks import planned_split


def test_hidden_units_split_over_tensor():
    assert planned_split("xor") == {"hidden.kernel", "hidden.bias", "output.kernel"}
