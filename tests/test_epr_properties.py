"""Property tests (hypothesis) for EPR and the capacity distribution.

Random shapes, capacities, exact ties and non-finite scores; every backend
must give the numpy reference's assignment (Algorithm 1, ties to the lower
token index, non-finite scores last), with exact per-example counts and no
token taken twice.
"""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numpy_reference as ref
from conftest import to_numpy
from keras_mone import routing

PROPERTY_SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
"""With the suite's hypothesis profile (``conftest``): 40 fixed examples per test by default
("fixed", reproducible), ``--hypothesis-profile explore`` for 400 fresh random ones."""


def feasible(position, experts):
    """The effective capacity at ``position`` in [0, 1] of the range E experts can realise."""
    smallest = 2.0 ** -(experts - 1)
    return smallest + position * (1.0 - smallest)


@st.composite
def router_probabilities(draw):
    """(batch, tokens, experts) probabilities with ties and some non-finite entries."""
    batch = draw(st.integers(1, 3))
    tokens = draw(st.integers(1, 40))
    experts = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    levels = draw(st.sampled_from([0, 2, 3, 7]))  # 0: continuous values
    rng = np.random.default_rng(seed)
    if levels:
        probs = rng.integers(0, levels, (batch, tokens, experts)) / (levels - 1)
    else:
        probs = rng.random((batch, tokens, experts))
    bad = rng.random((batch, tokens, experts)) < draw(st.sampled_from([0.0, 0.1, 0.5]))
    probs[bad] = rng.choice([np.nan, np.inf, -np.inf], size=int(bad.sum()))
    return probs.astype("float32")


@PROPERTY_SETTINGS
@given(probs=router_probabilities(), position=st.floats(0.0, 1.0))
def test_epr_matches_the_reference_for_any_input(probs, position):
    experts = probs.shape[2]
    capacities = routing.capacity_distribution(feasible(position, experts), num_experts=experts)
    counts, dropped = routing.expert_token_counts(capacities, probs.shape[1])
    got = to_numpy(routing.expert_preferred_routing(probs, capacities))
    for row in got:
        assert np.bincount(row + 1, minlength=experts + 1).tolist() == [dropped, *counts]
    np.testing.assert_array_equal(got, ref.expert_preferred_routing(probs, capacities))


@PROPERTY_SETTINGS
@given(position=st.floats(0.0, 1.0), experts=st.integers(1, 6))
def test_capacity_distribution_is_a_distribution_with_the_requested_mean_width(position, experts):
    capacity = feasible(position, experts)
    capacities = np.asarray(routing.capacity_distribution(capacity, num_experts=experts))
    widths = 2.0 ** (np.arange(experts) - (experts - 1))  # D/2^(E-1), ..., D/2, D, relative to D
    assert capacities.shape == (experts,)
    assert np.all(capacities >= 0)
    np.testing.assert_allclose(capacities.sum(), 1.0, atol=1e-6)
    np.testing.assert_allclose(capacities @ widths, capacity, atol=1e-4)
