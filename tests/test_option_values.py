"""Numbers that Python holds but a float cannot: every float option refuses them with a ValueError
naming the option (GenerateConfig's check, which both backends and the batching scheduler share)."""
from __future__ import annotations

from fractions import Fraction
from numbers import Real

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pymlxc.backends.metal.batching import SamplingParams
from pymlxc.options import GenerateConfig

FLOAT_OPTIONS = ("temperature", "top_p", "min_p", "repeat_penalty", "timeout")
BEYOND_FLOAT = st.one_of(
    st.integers(min_value=10**309, max_value=10**2000),
    st.integers(min_value=10**309, max_value=10**2000).map(lambda n: -n),
    st.integers(min_value=10**309, max_value=10**2000).map(lambda n: Fraction(n, 3)),
)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(FLOAT_OPTIONS), value=BEYOND_FLOAT)
def test_a_number_past_floats_range_is_a_value_error_naming_the_option(name: str, value: Real) -> None:
    # float() of it raised OverflowError, which names no option and is no ValueError.
    with pytest.raises(ValueError, match=f"^{name} must be finite"):
        GenerateConfig(**{name: value})


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"])
def test_the_batching_scheduler_refuses_them_too(name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name} must be finite"):
        SamplingParams(**{name: 10**400})
