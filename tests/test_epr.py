"""Expert Preferred Routing (Algorithm 1) against the numpy reference."""

import keras
import numpy as np
import pytest

import numpy_reference as ref
from conftest import per_example_counts, to_numpy
from keras_mone import layers, routing

E = 4


def continuous_probs(batch, tokens, experts=E, seed=0):
    """Softmax of random logits: ties have probability ~0 in float32."""
    logits = np.random.default_rng(seed).standard_normal((batch, tokens, experts)) * 2.0
    return ref.softmax(logits).astype("float32")


def quantised_probs(batch, tokens, experts=E, levels=3, seed=0):
    """Probabilities from {0, 1/(levels-1), ..., 1}: many exact ties, including at 0."""
    q = np.random.default_rng(seed).integers(0, levels, size=(batch, tokens, experts))
    return (q / (levels - 1)).astype("float32")


def epr(probs, capacities):
    out = to_numpy(routing.expert_preferred_routing(probs, capacities))
    assert out.shape == probs.shape[:2]
    assert out.dtype == np.int32
    return out


CAPACITIES = {
    "mone_0.3": lambda: routing.capacity_distribution(0.3),
    "mone_0.6": lambda: routing.capacity_distribution(0.6),
    "uniform": lambda: routing.uniform_distribution(4),
    "greedy_0.4": lambda: routing.greedy_distribution(0.4),
}


@pytest.mark.parametrize("name", sorted(CAPACITIES))
def test_matches_reference_on_continuous_probabilities(name):
    capacities = CAPACITIES[name]()
    probs = continuous_probs(4, 16, seed=sum(map(ord, name)))
    got = epr(probs, capacities)
    np.testing.assert_array_equal(got, ref.expert_preferred_routing(probs, capacities))
    ref.check_valid_epr(probs, capacities, got)


@pytest.mark.parametrize("levels", [2, 3, 5])
def test_ties_go_to_the_lower_token_index(levels):
    # Many exact ties, including at 0, where the paper's "null out with 0"
    # (Alg. 1 line 6) would be ambiguous: every backend must give the
    # reference's assignment (lower index first), not its top_k's tie order.
    capacities = routing.capacity_distribution(0.45)
    probs = quantised_probs(8, 16, levels=levels, seed=levels)
    got = epr(probs, capacities)
    ref.check_valid_epr(probs, capacities, got)
    np.testing.assert_array_equal(got, ref.expert_preferred_routing(probs, capacities))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 3e38])
def test_non_finite_probabilities_rank_last_and_no_token_is_taken_twice(bad):
    # Issue 13: on tensorflow, NaN probabilities made top_k re-pick assigned tokens.
    capacities = routing.capacity_distribution(0.5)
    probs = quantised_probs(4, 24, levels=4, seed=1)
    probs[0, 3] = bad
    probs[1, :10] = bad
    probs[2] = bad
    got = epr(probs, capacities)
    counts, _ = routing.expert_token_counts(capacities, 24)
    for row in got:
        assert np.bincount(row, minlength=E).tolist() == list(counts)
    np.testing.assert_array_equal(got, ref.expert_preferred_routing(probs, capacities))


def test_all_equal_probabilities():
    # exact ties everywhere: the first tokens go to the largest expert
    probs = np.full((2, 16, E), 0.25, "float32")
    capacities = routing.capacity_distribution(0.3)
    got = epr(probs, capacities)
    ref.check_valid_epr(probs, capacities, got)
    np.testing.assert_array_equal(got, ref.expert_preferred_routing(probs, capacities))


def test_fewer_tokens_than_experts():
    capacities = routing.capacity_distribution(0.7)  # ~ (0.15, 0.18, 0.25, 0.42)
    probs = continuous_probs(5, 3, seed=3)
    got = epr(probs, capacities)
    counts, dropped = routing.expert_token_counts(capacities, 3)
    assert sum(counts) == 3 and dropped == 0
    np.testing.assert_array_equal(got, ref.expert_preferred_routing(probs, capacities))
    ref.check_valid_epr(probs, capacities, got)


def test_capacities_that_round_to_zero():
    # floor(c_j * N) = 0 for every larger expert: all tokens go to the smallest.
    capacities = [0.4, 0.2, 0.2, 0.2]
    probs = continuous_probs(2, 4, seed=4)
    assert routing.expert_token_counts(capacities, 4) == ((4, 0, 0, 0), 0)
    got = epr(probs, capacities)
    np.testing.assert_array_equal(got, np.zeros((2, 4), np.int32))
    # and one expert in the middle rounding to zero
    capacities = [0.3, 0.05, 0.25, 0.4]
    probs = continuous_probs(3, 10, seed=5)
    assert routing.expert_token_counts(capacities, 10) == ((4, 0, 2, 4), 0)  # floor(2.5) = 2
    got = epr(probs, capacities)
    np.testing.assert_array_equal(got, ref.expert_preferred_routing(probs, capacities))


def test_per_example_counts_are_exact():
    capacities = routing.capacity_distribution(0.3)
    counts, dropped = routing.expert_token_counts(capacities, 16)
    probs = continuous_probs(8, 16, seed=6)
    got = epr(probs, capacities)
    np.testing.assert_array_equal(per_example_counts(got, E), np.tile(list(counts) + [dropped], (8, 1)))
    # k_j = floor(c_j N) for the larger experts, leftovers to the smallest
    assert counts[1:] == tuple(int(np.floor(c * 16)) for c in capacities[1:])
    assert counts[0] == 16 - sum(counts[1:])


def test_largest_expert_takes_its_top_tokens():
    # Alg. 1 gives the largest expert its top-k by its own probability, whatever the others say.
    probs = continuous_probs(2, 16, seed=7)
    capacities = routing.uniform_distribution(4)
    got = epr(probs, capacities)
    for b in range(2):
        top = np.argsort(-probs[b, :, E - 1])[:4]
        assert set(np.flatnonzero(got[b] == E - 1)) == set(top)


def test_mod_greedy_drops_tokens():
    capacities = routing.mod_greedy_distribution(0.3)
    assert np.isclose(sum(capacities), 0.3)
    probs = continuous_probs(3, 16, seed=8)
    got = epr(probs, capacities)
    counts, dropped = routing.expert_token_counts(capacities, 16)
    assert counts == (0, 0, 0, 4) and dropped == 12
    assert routing.DROPPED == -1
    np.testing.assert_array_equal(got, ref.expert_preferred_routing(probs, capacities))
    np.testing.assert_array_equal(per_example_counts(got, E), np.tile([0, 0, 0, 4, 12], (3, 1)))
    ref.check_valid_epr(probs, capacities, got)


# --------------------------------------------------------------------------
# expert_token_counts
# --------------------------------------------------------------------------
@pytest.mark.parametrize("capacities, n, expected", [
    ([0.25, 0.25, 0.25, 0.25], 16, ((4, 4, 4, 4), 0)),
    ([0.25, 0.25, 0.25, 0.25], 10, ((4, 2, 2, 2), 0)),
    ([0.7, 0.0, 0.0, 0.3], 10, ((7, 0, 0, 3), 0)),
    # 0.57 * 100 == 56.99999999999999 in float64: rules out flooring without the epsilon
    ([0.43, 0.0, 0.0, 0.57], 100, ((43, 0, 0, 57), 0)),
    ([0.0, 0.0, 0.0, 0.57], 100, ((0, 0, 0, 57), 43)),  # the same with dropped tokens
    ([0.0, 0.0, 0.0, 0.3], 10, ((0, 0, 0, 3), 7)),  # capacities sum < 1: dropped tokens
    ([0.0, 0.0, 0.0, 1.0], 16, ((0, 0, 0, 16), 0)),
    ([1.0], 5, ((5,), 0)),
    ([0.1, 0.2, 0.3, 0.4], 1, ((1, 0, 0, 0), 0)),
])
def test_expert_token_counts(capacities, n, expected):
    assert routing.expert_token_counts(capacities, n) == expected


def test_expert_token_counts_on_a_grid():
    for e_c in np.linspace(0.125, 1.0, 36):
        for method in ("mone", "greedy", "mod_greedy"):
            from keras_mone.routing.capacity import distribution_for

            c = distribution_for(method, float(e_c), 4)
            for n in (1, 3, 4, 7, 16, 197, 196 * 8):
                counts, dropped = routing.expert_token_counts(c, n)
                assert all(k >= 0 for k in counts) and dropped >= 0
                assert sum(counts) + dropped == n
                assert list(counts) + [dropped] == list(ref.token_counts(c, n)[0]) + [ref.token_counts(c, n)[1]]


@pytest.mark.parametrize("bad", [[0.5, -0.1, 0.6], [0.6, 0.6], [[0.5, 0.5]], []])
def test_expert_token_counts_rejects_bad_capacities(bad):
    with pytest.raises(ValueError, match="capacities"):
        routing.expert_token_counts(bad, 10)


def test_function_argument_errors():
    with pytest.raises(ValueError, match="router_probs"):
        routing.expert_preferred_routing(np.zeros((16, 4), "float32"), [0.25] * 4)
    with pytest.raises(ValueError, match="capacities"):
        routing.expert_preferred_routing(np.zeros((1, 16, 4), "float32"), [0.5, 0.5])


# --------------------------------------------------------------------------
# ExpertPreferredRouting layer
# --------------------------------------------------------------------------
def test_layer_matches_function_and_groups():
    layer = layers.ExpertPreferredRouting(4, effective_capacity=0.3)
    np.testing.assert_allclose(layer.capacities, routing.capacity_distribution(0.3), rtol=0, atol=0)
    probs = continuous_probs(3, 16, seed=9)
    labels = to_numpy(layer(probs))
    np.testing.assert_array_equal(labels, epr(probs, layer.capacities))
    groups, dropped = layer.group(probs)
    counts, n_dropped = layer.token_counts(16)
    assert [g.shape[1] for g in groups] == list(counts) and dropped.shape[1] == n_dropped == 0
    for j, g in enumerate(groups):
        g = to_numpy(g)
        for b in range(3):
            assert set(g[b]) == set(np.flatnonzero(labels[b] == j))


def test_layer_set_capacity_and_methods():
    layer = layers.ExpertPreferredRouting(4, effective_capacity=0.5)
    before = layer.capacities
    layer.set_capacity(0.8)
    assert layer.effective_capacity == 0.8
    assert layer.capacities != before
    assert abs(routing.effective_capacity(layer.capacities) - 0.8) < 1e-6
    greedy = layers.ExpertPreferredRouting(4, 0.4, capacity_method="greedy")
    np.testing.assert_allclose(greedy.capacities, routing.greedy_distribution(0.4))
    mod = layers.ExpertPreferredRouting(4, 0.05, capacity_method="mod_greedy")
    probs = continuous_probs(2, 16, seed=10)
    labels = to_numpy(mod(probs))
    assert (labels == -1).sum(axis=1).tolist() == [16, 16]  # floor(0.05 * 16) = 0 tokens processed


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, float("nan"), 0.1, "half"])
def test_layer_rejects_bad_capacity(bad):
    with pytest.raises(ValueError, match="effective_capacity"):
        layers.ExpertPreferredRouting(4, effective_capacity=bad)
    layer = layers.ExpertPreferredRouting(4, 0.5)
    with pytest.raises(ValueError, match="effective_capacity"):
        layer.set_capacity(bad)
    assert layer.effective_capacity == 0.5  # unchanged after a rejected value


def test_layer_rejects_unknown_method():
    with pytest.raises(ValueError, match="capacity_method"):
        layers.ExpertPreferredRouting(4, 0.5, capacity_method="nope")


def test_layer_in_a_functional_model():
    # Static counts: the layer works on symbolic tensors and in a compiled predict.
    inputs = keras.Input((16, E))
    model = keras.Model(inputs, layers.ExpertPreferredRouting(E, 0.3)(inputs))
    probs = continuous_probs(2, 16, seed=11)
    np.testing.assert_array_equal(
        model.predict(probs, verbose=0), ref.expert_preferred_routing(probs, routing.capacity_distribution(0.3))
    )
