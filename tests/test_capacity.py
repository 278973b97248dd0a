"""Capacity distributions: Eq. 3 (Sec. 4.3) and the Table 2 baselines."""

import numpy as np
import pytest
from scipy.linalg import null_space

import numpy_reference as ref
from conftest import TINY, images, randomize_weights, to_numpy
from keras_mone import routing
from keras_mone.models import ImageClassifier, MoNEViTBackbone

BETA, DELTA = 10.0, 2.0
# Eq. 3 as printed: c_i / delta**(i - 1), i = 1 smallest.
PRINTED_REWARD = DELTA ** -np.arange(4, dtype=float)  # [1, 1/2, 1/4, 1/8]
LIBRARY_REWARD = PRINTED_REWARD  # the library solves Eq. 3 as printed (capacity.py)
GRID = np.linspace(0.125, 1.0, 351)  # step 0.0025, both ends included


def check_distribution(c, e_c, num_experts=4):
    c = np.asarray(c, dtype=np.float64)
    assert c.shape == (num_experts,)
    assert np.all(c >= 0.0) and np.all(c <= 1.0)
    assert abs(c.sum() - 1.0) <= 1e-9
    assert abs(routing.effective_capacity(c) - e_c) <= 1e-6


def test_width_fractions_and_effective_capacity():
    assert routing.minimum_effective_capacity(4) == 0.125
    assert routing.minimum_effective_capacity(6) == 1 / 32
    assert routing.effective_capacity([0, 0, 0, 1]) == 1.0
    assert routing.effective_capacity([1, 0, 0, 0]) == 0.125
    assert routing.effective_capacity([0.25] * 4) == pytest.approx(0.46875, abs=1e-15)


def test_solves_on_a_fine_grid():
    for e_c in GRID:
        check_distribution(routing.capacity_distribution(float(e_c)), e_c)


def test_matches_the_exact_optimum_of_the_library_objective():
    # Strictly concave objective -> unique optimum, in closed (Gibbs) form for
    # 1/8 < e_c < 1. SLSQP stops within ~2e-6 of it (measured); 1e-5 is a 5x margin.
    for e_c in GRID[1:-1]:
        c = routing.capacity_distribution(float(e_c))
        exact = ref.entropy_regularised_optimum(e_c, LIBRARY_REWARD, BETA)
        np.testing.assert_allclose(c, exact, rtol=0, atol=1e-5, err_msg=f"e_c={e_c}")


def test_endpoints():
    np.testing.assert_array_equal(routing.capacity_distribution(1.0), [0, 0, 0, 1])
    np.testing.assert_array_equal(routing.capacity_distribution(0.125), [1, 0, 0, 0])


def test_beats_random_feasible_points():
    rng = np.random.default_rng(0)
    w = ref.width_fractions(4)
    basis = null_space(np.stack([np.ones(4), w]))  # directions keeping sum c and e_c fixed
    for e_c in (0.2, 0.3, 0.5, 0.75, 0.9):
        c = routing.capacity_distribution(e_c)
        best = ref.eq3_objective(c, LIBRARY_REWARD, BETA)
        for _ in range(300):
            direction = basis @ rng.standard_normal(2)
            # largest step keeping every entry >= 0, then a random fraction of it
            limits = [-ci / di for ci, di in zip(c, direction) if di < 0]
            point = c + rng.uniform(0, min(limits)) * direction
            assert abs(point.sum() - 1) < 1e-12 and abs(point @ w - e_c) < 1e-12 and point.min() >= -1e-12
            assert ref.eq3_objective(point, LIBRARY_REWARD, BETA) <= best + 1e-10


def test_solves_eq3_as_printed():
    # The documented choice (capacity.py): Eq. 3 exactly as printed, reward
    # c_i / delta**(i-1) with i = 1 the smallest expert. Compare with the
    # closed-form optimum of that objective (numpy_reference).
    for e_c in (0.2, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9):
        c = routing.capacity_distribution(e_c)
        np.testing.assert_allclose(c, ref.entropy_regularised_optimum(e_c, PRINTED_REWARD, BETA), atol=1e-5)


def test_printed_linear_term_favours_the_full_expert():
    # Relative to the entropy-only solution, the printed term moves capacity to
    # the full expert: the text's "we incentivize the usage of larger models".
    for e_c in (0.25, 0.4, 0.5, 0.6, 0.75):
        c = routing.capacity_distribution(e_c)
        max_entropy = ref.entropy_regularised_optimum(e_c, np.zeros(4), BETA)
        assert c[-1] > max_entropy[-1] + 1e-4, (e_c, c, max_entropy)


def test_literal_text_reward_would_be_a_no_op():
    # The alternative reading, reward 1 / delta**(E-i), equals d_i / D at
    # delta = 2, so reward @ c == e_c on the whole feasible set: its optimum is
    # the entropy-only one. This is why the library keeps the printed term.
    w = ref.width_fractions(4)
    text_reward = 2.0 ** -np.arange(3, -1, -1)
    np.testing.assert_allclose(text_reward, w)
    for e_c in (0.25, 0.5, 0.75):
        np.testing.assert_allclose(
            ref.entropy_regularised_optimum(e_c, text_reward, BETA),
            ref.entropy_regularised_optimum(e_c, np.zeros(4), BETA), atol=1e-9,
        )


@pytest.mark.parametrize("e_c", [0.05, 0.08, 0.1, 0.12, 0.1249])
def test_infeasible_below_one_eighth_with_four_experts(e_c):
    # sum c = 1 and c >= 0 imply e_c >= 1/8 with E = 4.
    with pytest.raises(ValueError, match="effective_capacity") as info:
        routing.capacity_distribution(e_c, 4)
    assert "0.125" in str(info.value) and "num_experts" in str(info.value)


def test_six_experts_reach_down_to_0_05():
    for e_c in np.linspace(0.05, 1.0, 191):
        check_distribution(routing.capacity_distribution(float(e_c), 6), e_c, 6)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.0001, 2.0, float("nan"), float("inf"), None, "x"])
def test_rejects_values_outside_the_unit_interval(bad):
    with pytest.raises(ValueError, match="effective_capacity"):
        routing.capacity_distribution(bad)
    with pytest.raises(ValueError, match="effective_capacity"):
        routing.greedy_distribution(bad)
    with pytest.raises(ValueError, match="effective_capacity"):
        routing.mod_greedy_distribution(bad)


def test_rejects_bad_solver_parameters():
    with pytest.raises(ValueError, match="beta"):
        routing.capacity_distribution(0.5, beta=0.0)
    with pytest.raises(ValueError, match="delta"):
        routing.capacity_distribution(0.5, delta=1.0)
    with pytest.raises(ValueError, match="num_experts"):
        routing.capacity_distribution(0.5, num_experts=0)


def test_uniform_and_proportionate():
    u = routing.uniform_distribution(4)
    np.testing.assert_allclose(u, [0.25] * 4, rtol=0, atol=0)
    assert routing.effective_capacity(u) == pytest.approx(0.46875, abs=1e-15)  # Table 2: 0.47
    p = routing.proportionate_distribution(4)
    np.testing.assert_allclose(p, np.array([8, 4, 2, 1]) / 15, rtol=0, atol=1e-15)  # c_i ∝ D / d_i
    assert routing.effective_capacity(p) == pytest.approx(4 / 15, abs=1e-15)  # Table 2: 0.27


@pytest.mark.parametrize("e_c", [0.125, 0.2, 0.4, 0.8, 1.0])
def test_greedy(e_c):
    c = routing.greedy_distribution(e_c)
    check_distribution(c, e_c)
    assert c[1] == 0 and c[2] == 0  # only the smallest and the full expert
    assert c[3] == pytest.approx((e_c - 0.125) / 0.875, abs=1e-12)


@pytest.mark.parametrize("e_c", [0.05, 0.3, 0.4, 1.0])
def test_mod_greedy(e_c):
    c = routing.mod_greedy_distribution(e_c)
    np.testing.assert_allclose(c, [0, 0, 0, e_c], rtol=0, atol=0)
    assert routing.effective_capacity(c) == pytest.approx(e_c)  # the full expert spends the whole budget
    # 1 - sum c of the tokens are dropped
    counts, dropped = routing.expert_token_counts(c, 20)
    assert counts[-1] == int(np.floor(e_c * 20 + 1e-9)) and dropped == 20 - counts[-1]


# --------------------------------------------------------------------------
# Compiled functions per capacity (models/capacity_control.py)
# --------------------------------------------------------------------------
def test_recompiling_does_not_bring_back_functions_of_the_old_loss():
    # Rules out: the per-capacity function cache keyed on the capacity alone
    # (compile generation ignored), which makes evaluate at a capacity seen
    # before the last compile() return the old loss (issue 30, item 0).
    model = ImageClassifier(MoNEViTBackbone(**TINY, capacity=0.5), num_classes=3)
    model.build()
    randomize_weights(model, seed=7)
    x = images(seed=5)
    y = np.random.default_rng(5).standard_normal((len(x), 3)).astype("float32")

    def loss_at(capacity, name):
        model.set_capacity(capacity)
        error = to_numpy(model(x)).astype(np.float64) - y
        expected = float(np.mean(error**2 if name == "mse" else np.abs(error)))
        assert model.evaluate(x, y, verbose=0) == pytest.approx(expected, rel=1e-5), (capacity, name)
        return expected

    model.compile(loss="mse")
    mse = loss_at(0.5, "mse")
    old_function = model.test_function
    loss_at(0.25, "mse")
    model.compile(loss="mae")
    mae = loss_at(0.5, "mae")
    assert abs(mae - mse) > 1e-2 * mse  # the two losses are told apart
    # torch runs its steps eagerly, so a stale function there still reads the
    # new loss: that the function was rebuilt is checked on every backend.
    assert model.test_function is not old_function


def test_just_above_the_smallest_capacity_the_solver_still_finds_eq3s_optimum():
    """SLSQP reports "Inequality constraints incompatible" at e_c 0.0361 with 6 experts (a
    case hypothesis found); Eq. 3's maximiser then comes from its Lagrangian's stationary
    point, which equals SLSQP's answer to 1e-8 wherever SLSQP succeeds."""
    from keras_mone.routing import capacity

    widths = capacity.expert_width_fractions(6)
    c = capacity.capacity_distribution(0.03609375, num_experts=6)
    assert np.all(c >= 0) and abs(c.sum() - 1) < 1e-9 and abs(c @ widths - 0.03609375) < 1e-9
    for experts in (3, 4, 6):
        widths = capacity.expert_width_fractions(experts)
        reward = 2.0 ** -np.arange(experts)
        for e_c in np.linspace(widths[0] + 0.01, 0.99, 9):
            slsqp = np.array(capacity._solve_eq3(float(e_c), experts, 10.0, 2.0))
            dual = capacity._solve_eq3_dual(float(e_c), widths, reward, 10.0)
            np.testing.assert_allclose(dual, slsqp, atol=1e-8)
