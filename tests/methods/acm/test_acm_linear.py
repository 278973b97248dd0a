"""ACMLinear (issue 25 item 2, optional part): low-rank learners for Q, K, V and O.

References: float64 numpy (truncated SVD, per-token ``h(z, k)``) and the quota
cascade of ``test_acm_layers``. Each test names the wrong variant it rules out.
"""

import keras
import numpy as np
import pytest

from conftest import assert_f32_close, config_roundtrip, gradients, randomize_weights, to_numpy
from keras_mone.layers import ACMGate, ACMLinear
from keras_mone.methods.acm.linear import default_rank
from keras_mone.methods.acm import quotas as acm_quotas
from keras_mone.methods.acm import losses as acm_losses
from test_acm_layers import rand, ref_assign

D, UNITS, N, R, T, B = 8, 6, 4, 1, 10, 2


def linear(seed=1, **kwargs):
    layer = ACMLinear(D, UNITS, N, rank=kwargs.pop("rank", R), **kwargs)
    layer.build((None, T, D))
    randomize_weights(layer, seed=seed, scale=0.5)
    return layer


def params(layer):
    w = {v.path.split("/", 1)[1]: to_numpy(v).astype(np.float64) for v in layer.weights}
    return w["down/kernel"], w["down/bias"], w["up/kernel"], w["up/bias"]


def ref_h(z, k, down, down_bias, up, up_bias):
    width = k * down.shape[1] // N
    return (np.asarray(z, np.float64) @ down[:, :width] + down_bias[:width]) @ up[:width] + up_bias


def ref_per_token(z, counts, layer):
    out = np.zeros(z.shape[:-1] + (UNITS,))
    for b, t in np.ndindex(*counts.shape):
        out[b, t] = ref_h(z[b, t], int(counts[b, t]), *params(layer))
    return out


def test_default_rank_is_the_papers():
    # rules out: a rank per learner of D / N (twice the dense cost) or a missing N.
    assert default_rank(768, 768, 4) == 96
    assert default_rank(8, 8, 4) == 1 and default_rank(192, 576, 4) == 36


def test_svd_initialisation_gives_the_best_rank_k_r_approximations():
    # rules out: singular directions in the wrong order (smallest first), the dense
    # bias on a later learner, k = N not exact when N r reaches the kernel's rank.
    rng = np.random.default_rng(2)
    kernel, bias = rng.standard_normal((D, UNITS)), rng.standard_normal(UNITS)
    u, s, vt = np.linalg.svd(kernel, full_matrices=False)
    layer = ACMLinear(D, UNITS, N, rank=2)  # N r = 8 >= rank 6
    layer.load_dense(kernel, bias)
    z = rand(B, T, D)
    for k in range(1, N + 1):
        r = min(2 * k, s.size)
        assert_f32_close(to_numpy(layer.output_at(z, k)), z @ (u[:, :r] * s[:r]) @ vt[:r] + bias)
    assert_f32_close(to_numpy(layer(z, np.full((B, T), N))), z @ kernel + bias)


def test_exact_mode_matches_the_reference_with_counts_from_one():
    # rules out: the gate's column c read as k = c (not c + 1); the up bias dropped.
    layer, z = linear(), rand(B, T, D)
    counts = np.random.default_rng(3).integers(1, N + 1, (B, T))
    expected = ref_per_token(z, counts, layer)
    assert_f32_close(to_numpy(layer(z, counts)), expected)
    assert_f32_close(to_numpy(layer(z, np.eye(N, dtype="float32")[counts - 1])), expected)
    stack = to_numpy(layer.all_outputs(z))
    np.testing.assert_array_equal(stack[:, :, 0], 0.0)
    for k in range(1, N + 1):
        assert_f32_close(stack[:, :, k], ref_h(z, k, *params(layer)))


def test_gradient_wrt_choices_is_h_of_each_count():
    # rules out: a training path that is not linear in the gate's one-hot.
    layer, z, weights = linear(), rand(B, T, D), rand(B, T, UNITS, seed=5)

    class Probe(keras.layers.Layer):
        def build(self, _):
            self.choices = self.add_weight(shape=(B, T, N), initializer="zeros")
            self.choices.assign(np.eye(N, dtype="float32")[np.random.default_rng(4).integers(0, N, (B, T))])

        def call(self, x, training=None):
            return layer(x, self.choices, training=training)

    probe = Probe()
    probe.build(None)
    loss = lambda out: keras.ops.sum(keras.ops.multiply(out, weights))  # noqa: E731
    (grad,) = gradients(probe, loss, z, [probe.choices])
    expected = np.stack([(ref_h(z, k, *params(layer)) * weights).sum(-1) for k in range(1, N + 1)], -1)
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-4)


def test_grouped_mode_runs_learner_one_everywhere_and_quotas_on_the_rest():
    # rules out: learner 1 limited by a quota (tokens losing their only learner), the
    # optional learners' budget not net of learner 1, no quota for learners 2..N.
    layer, z = linear(beta=0.5), rand(B, T, D)
    caps = layer.caps(T)
    assert caps[0] == T and caps[1:] == acm_quotas.learner_caps(T, N - 1, (0.5 * N - 1) / (N - 1))
    rng = np.random.default_rng(7)
    counts = rng.integers(1, N + 1, (B, T))
    confidence = rng.uniform(size=(B, T)).astype("float32")
    final = ref_assign(counts - 1, confidence, caps[1:]) + 1
    assert (final != counts).any()
    np.testing.assert_array_equal(to_numpy(layer.final_counts(counts, confidence, mode="grouped")), final)
    expected = ref_per_token(z, final, layer)
    assert_f32_close(to_numpy(layer(z, counts, confidence, mode="grouped")), expected)
    one_hot = np.eye(N, dtype="float32")[counts - 1]  # the gate's output, column c = count c + 1
    assert_f32_close(to_numpy(layer(z, one_hot, confidence, mode="grouped")), expected)
    free = linear(beta=None)
    np.testing.assert_allclose(
        to_numpy(free(z, counts, mode="grouped")), to_numpy(free(z, counts)), rtol=0, atol=1e-5
    )


def test_losses_take_a_one_hot_from_one_through_with_zero_choice():
    # rules out: the padding column on the wrong side (counts shifted down by one).
    choices = np.eye(N, dtype="float32")[np.array([[0, 3], [1, 1]])]  # k = 1, 4 and 2, 2
    fraction = to_numpy(acm_losses.learner_fraction(acm_losses.with_zero_choice(choices)))
    np.testing.assert_allclose(fraction, [5 / 8, 4 / 8], rtol=1e-6)


def test_round_trip_and_errors(tmp_path):
    # rules out: rank / units missing from get_config; bad budgets or shapes accepted.
    z = keras.Input((T, D))
    gate, proj = ACMGate(N, seed=2), ACMLinear(D, UNITS, N, rank=2, mode="grouped", beta=0.6)
    choice, probs = gate(z)
    model = keras.Model(z, proj(z, choice, keras.ops.max(probs, axis=-1)))
    randomize_weights(model, seed=3, scale=0.5)
    x = rand(B, T, D)
    expected = to_numpy(model(x))
    model.save(tmp_path / "proj.keras")
    np.testing.assert_array_equal(to_numpy(keras.saving.load_model(tmp_path / "proj.keras")(x)), expected)
    assert config_roundtrip(proj).get_config()["rank"] == 2
    with pytest.raises(ValueError, match="beta"):
        ACMLinear(D, num_learners=4, beta=0.25)  # every token runs 1 of 4 learners already
    with pytest.raises(ValueError, match="kernel"):
        ACMLinear(D, UNITS, N).load_dense(np.zeros((UNITS, D)))
    with pytest.raises(ValueError, match="choices"):
        linear()(rand(B, T, D), np.zeros((B, T, N + 1), "float32"))
