"""ACM layers (issue 25 items 2-3): ACMMLP, ACMGate, the quota rule and the losses.

References are float64 numpy re-implementations written here from the paper
(``h(z, k)``, the tau rule, L_budget / L_entropy / L_diversity) and from the
documented quota rule (as a level-by-level cascade, not the library's single
ranking). Each test names in a comment the wrong variant it rules out
(issue 30's "Also").
"""

import keras
import numpy as np
import pytest

import numpy_reference as ref
from conftest import assert_f32_close, config_roundtrip, gradients, randomize_weights, to_numpy
from keras_mone.layers import ACMGate, ACMMLP, NestedMLP
from keras_mone.methods.acm import quotas as acm_quotas
from keras_mone.methods.acm import losses as acm_losses

D, M, N, T, B = 8, 16, 4, 10, 2  # 4 learners of 4 hidden units; 10 tokens


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def acm(seed=1, **kwargs):
    layer = ACMMLP(D, M, N, **kwargs)
    layer.build((None, T, D))
    randomize_weights(layer, seed=seed, scale=0.5)
    return layer


def params(layer):
    w = {v.path.split("/", 1)[1]: to_numpy(v).astype(np.float64) for v in layer.weights}
    return w["fc1/kernel"], w["fc1/bias"], w["fc2/kernel"], w["fc2/bias"]


def ref_h(z, k, w1, b1, w2, b2):
    """``h(z, k)``: the MLP at hidden width ``k M / N`` (learner 1 owns fc2's bias)."""
    if k == 0:
        return np.zeros(np.shape(z)[:-1] + (w2.shape[1],))
    width = k * w1.shape[1] // N
    return ref.gelu(np.asarray(z, np.float64) @ w1[:, :width] + b1[:width]) @ w2[:width] + b2


def ref_per_token(z, counts, layer):
    w = params(layer)
    out = np.zeros(z.shape, np.float64)
    for b in range(z.shape[0]):
        for t in range(z.shape[1]):
            out[b, t] = ref_h(z[b, t], int(counts[b, t]), *w)
    return out


def ref_assign(counts, confidence, caps):
    """The quota rule as a cascade: from ``k = N`` down, tokens at ``k`` (chosen or
    dropped there) beyond ``caps[k-1] - #(final > k)`` drop to ``k - 1``, the
    lowest-ranked (chosen count, then confidence, then lower index) first."""
    final = np.array(counts, np.int64)
    for b in range(final.shape[0]):
        for k in range(len(caps), 0, -1):
            room = caps[k - 1] - int(np.sum(final[b] > k))
            here = [t for t in range(final.shape[1]) if final[b, t] == k]
            here.sort(key=lambda t: (-counts[b, t], -confidence[b, t], t))
            for t in here[room:]:
                final[b, t] = k - 1
    return final


# --------------------------------------------------------------------------- ACMMLP
def test_full_count_is_the_dense_mlp_on_the_same_weights():
    # rules out: fc2's bias missing or added once per learner; learners slicing the
    # wrong hidden units; weight paths differing from the dense MLP's (no direct load).
    dense = NestedMLP(D, M)
    dense.build((None, T, D))
    randomize_weights(dense, seed=2, scale=0.5)
    layer = ACMMLP(D, M, N)
    layer.build((None, T, D))
    dense_paths = {v.path.split("/", 1)[1]: v for v in dense.weights}
    assert sorted(dense_paths) == sorted(v.path.split("/", 1)[1] for v in layer.weights)
    for v in layer.weights:
        v.assign(dense_paths[v.path.split("/", 1)[1]])
    z = rand(B, T, D)
    expected = to_numpy(dense(z))
    full = np.full((B, T), N)
    outputs = (layer(z, full), layer(z, full, mode="grouped"), layer.output_at(z, N), layer.all_outputs(z)[:, :, N])
    for actual in outputs:
        np.testing.assert_allclose(to_numpy(actual), expected, rtol=0, atol=1e-5)


def test_zero_count_adds_exactly_nothing():
    # rules out: the output bias applied at k = 0 (the module would not be skippable).
    layer, z = acm(), rand(B, T, D)
    zero = np.zeros((B, T), "int32")
    outputs = (layer(z, zero), layer(z, zero, mode="grouped"), layer.output_at(z, 0), layer.all_outputs(z)[:, :, 0])
    for actual in outputs:
        np.testing.assert_array_equal(to_numpy(actual), 0.0)


def test_exact_mode_and_all_outputs_match_the_numpy_reference():
    # rules out: a mask off by one learner (the official gated forward skips the top
    # learner), masks by the last units instead of the first, counts read from a
    # one-hot the wrong way round.
    layer, z = acm(), rand(B, T, D)
    counts = np.random.default_rng(3).integers(0, N + 1, (B, T))
    expected = ref_per_token(z, counts, layer)
    assert_f32_close(to_numpy(layer(z, counts)), expected)
    assert_f32_close(to_numpy(layer(z, np.eye(N + 1, dtype="float32")[counts])), expected)
    stack = to_numpy(layer.all_outputs(z))
    for k in range(N + 1):
        assert_f32_close(stack[:, :, k], ref_h(z, k, *params(layer)))
        assert_f32_close(to_numpy(layer.output_at(z, k)), ref_h(z, k, *params(layer)))


def test_exact_mode_gradient_wrt_choices_is_h_of_each_count():
    # rules out: a training path that is not linear in the one-hot (argmax inside, or the
    # bias gated by argmax): the straight-through gradient d out / d choice_k must be h(z, k).
    layer, z = acm(), rand(B, T, D)
    weights = rand(B, T, D, seed=5)

    class Probe(keras.layers.Layer):
        def build(self, _):
            self.choices = self.add_weight(shape=(B, T, N + 1), initializer="zeros")
            self.choices.assign(np.eye(N + 1, dtype="float32")[np.random.default_rng(4).integers(0, N + 1, (B, T))])

        def call(self, x, training=None):
            return layer(x, self.choices, training=training)

    probe = Probe()
    probe.build(None)
    (grad,) = gradients(probe, lambda out: keras.ops.sum(keras.ops.multiply(out, weights)), z, [probe.choices])
    expected = np.stack([(ref_h(z, k, *params(layer)) * weights).sum(-1) for k in range(N + 1)], -1)
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-4)


def test_grouped_equals_exact_when_no_quota_binds():
    # rules out: grouped outputs scattered back in the ranked order (not the tokens'),
    # learners run on unsorted prefixes, tokens moved although their quota had room.
    layer, z = acm(beta=0.5), rand(B, T, D)
    assert layer.caps(T) == (8, 6, 4, 2)  # uniform shares 0.2 at beta 0.5
    rng = np.random.default_rng(6)
    counts = np.stack([rng.permutation(np.repeat(np.arange(N + 1), 2)) for _ in range(B)])  # fits exactly
    confidence = rng.uniform(size=(B, T)).astype("float32")
    exact = to_numpy(layer(z, counts))
    np.testing.assert_allclose(to_numpy(layer(z, counts, confidence, mode="grouped")), exact, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(to_numpy(layer.final_counts(counts, confidence, mode="grouped")), counts)
    free = acm(beta=None)  # no quotas at all: any counts
    counts = rng.integers(0, N + 1, (B, T))
    np.testing.assert_allclose(to_numpy(free(z, counts, mode="grouped")), to_numpy(free(z, counts)), rtol=0, atol=1e-5)


def test_grouped_mode_under_binding_quotas_matches_the_reference():
    # rules out: dropping the most confident tokens first, dropping to 0 instead of
    # the next lower count, learners ignoring the quota (running on every token).
    layer, z = acm(beta=0.25), rand(B, T, D)
    rng = np.random.default_rng(7)
    counts = rng.integers(2, N + 1, (B, T))  # far above a quarter of the learners
    confidence = rng.uniform(size=(B, T)).astype("float32")
    final = ref_assign(counts, confidence, layer.caps(T))
    assert (final != counts).any() and (final > 0).any()
    np.testing.assert_array_equal(to_numpy(layer.final_counts(counts, confidence, mode="grouped")), final)
    assert_f32_close(to_numpy(layer(z, counts, confidence, mode="grouped")), ref_per_token(z, final, layer))


# --------------------------------------------------------------------------- quota rule
@pytest.mark.parametrize("beta", [0.1, 0.25, 0.5, 0.6, 0.9, 1.0])
def test_shares_are_the_max_entropy_histogram_with_mean_beta(beta):
    # rules out: shares whose mean misses the budget, or not geometric (not max-entropy).
    p = np.array(acm_quotas.max_entropy_shares(N, beta))
    assert abs(p.sum() - 1) < 1e-9 and abs(p @ np.arange(N + 1) - beta * N) < 1e-6
    if beta < 1:
        np.testing.assert_allclose(p[1:] / p[:-1], p[1] / p[0], rtol=1e-6)
    caps = acm_quotas.learner_caps(100, N, beta)
    tail = np.cumsum(p[::-1])[::-1][1:]
    np.testing.assert_array_equal(caps, np.minimum(100, np.ceil(100 * tail - 1e-9)))
    assert list(caps) == sorted(caps, reverse=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_assign_counts_and_moved_share_match_the_cascade(seed):
    # rules out: ranking by confidence alone (ignoring the chosen count), dropped tokens
    # ranked behind the lower count's own tokens, counts raised above the gate's choice.
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, N + 1, (3, 12))
    confidence = rng.uniform(size=(3, 12)).astype("float32")
    caps = acm_quotas.learner_caps(12, N, 0.3)
    order, ranked, final = (to_numpy(x) for x in acm_quotas.assign_counts(counts, confidence, caps))
    expected = ref_assign(counts, confidence, caps)
    np.testing.assert_array_equal(final, expected)
    np.testing.assert_array_equal(np.take_along_axis(final, order, 1), ranked)
    assert (np.diff(ranked, axis=1) <= 0).all()  # learner n runs on a prefix
    share = float(to_numpy(acm_quotas.moved_share(counts, final)))
    assert share == pytest.approx(np.mean(expected != counts)) and share > 0


# --------------------------------------------------------------------------- ACMGate
def gate_reference_logits(gate, z):
    w = {v.path.split("/", 1)[1]: to_numpy(v).astype(np.float64) for v in gate.weights}
    h = z
    for name in ("fc1", "fc2", "fc3"):  # linear, no activations
        h = h @ w[f"{name}/kernel"] + w[f"{name}/bias"]
    return h


def test_gate_inference_is_the_argmax_and_probs_the_softmax():
    # rules out: activations between the gate's layers; noise at inference.
    gate = ACMGate(N + 1, seed=0)
    z = rand(B, T, D)
    choice, probs = gate(z)
    logits = gate_reference_logits(gate, z)
    assert_f32_close(to_numpy(probs), ref.softmax(logits))
    np.testing.assert_array_equal(to_numpy(choice), np.eye(N + 1)[logits.argmax(-1)])


def test_gate_training_samples_are_one_hot_gumbel_max_draws():
    # rules out: a soft (not one-hot) forward; argmax without noise in training; the
    # wrong noise sign (-log(-log u) added as +log(-log u) skews the draws).
    gate = ACMGate(N + 1, seed=3)
    gate.build((None, D))
    randomize_weights(gate, seed=8, scale=0.2)
    gate.fc3.kernel.assign(np.zeros((16, N + 1), "float32"))
    gate.fc3.bias.assign(np.array([1.5, 0.0, 0.5, -1.0, 0.8], "float32"))  # softmax .46 .10 .17 .04 .23
    z = np.repeat(rand(1, D), 4000, axis=0)  # one token, 4000 draws
    choice, probs = (to_numpy(x) for x in gate(z, training=True))
    assert set(np.unique(choice)) == {0.0, 1.0} and (choice.sum(-1) == 1).all()
    # P(argmax(l + g) = c) = softmax(l)_c; the reflected noise would give .55 .06 .15 .005 .24
    np.testing.assert_allclose(choice.mean(0), probs[0], atol=0.03)


def test_task_loss_gradients_reach_the_gate_through_the_acm():
    # rules out: a hard choice without the straight-through term (no gradient to the gate,
    # as in the official code).
    class Module(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.gate, self.mlp = ACMGate(N + 1, seed=4), acm()

        def call(self, x, training=None):
            return self.mlp(x, self.gate(x, training=training)[0], training=training)

    module, z = Module(), rand(B, T, D)
    module(z)
    weights = rand(B, T, D, seed=9)
    loss = lambda out: keras.ops.sum(keras.ops.multiply(out, weights))  # noqa: E731
    grads = gradients(module, loss, z, module.gate.trainable_variables)
    assert all(g is not None and np.abs(g).max() > 0 for g in grads)


# --------------------------------------------------------------------------- losses
def one_hots(seed, batch=3, tokens=T, choices=N + 1):
    return np.eye(choices, dtype="float32")[np.random.default_rng(seed).integers(0, choices, (batch, tokens))]


def test_distillation_loss_matches_numpy():
    # rules out: including k = 0, a mean over features instead of the squared norm.
    stacks = [rand(B, T, N + 1, D, seed=s) for s in (1, 2)]
    targets = [rand(B, T, D, seed=s) for s in (3, 4)]
    expected = np.mean([((s[:, :, 1:] - t[:, :, None]) ** 2).sum(-1).mean() for s, t in zip(stacks, targets)])
    assert float(to_numpy(acm_losses.distillation_loss(stacks, targets))) == pytest.approx(expected, rel=1e-5)


def test_gate_labels_follow_the_tau_rule():
    # rules out: labelling n - 1, the inverted ratio d(n-1)/d(n), a fallback of 0 or 1
    # instead of N, a division that turns d(n-1) = 0 into no label.
    rng = np.random.default_rng(10)
    target = rng.standard_normal((B, T, D))
    stack = target[:, :, None] + rng.standard_normal((B, T, N + 1, D)) * rng.uniform(0.05, 2, (B, T, N + 1, 1))
    stack[0, 0, 1:] = target[0, 0]  # d(1) = 0: stalls at n = 2
    stack[0, 1, 1:] = target[0, 1] + 0.1 ** np.arange(1, N + 1)[:, None]  # d(n) / d(n-1) = 0.1: label N
    tau = 0.8
    d = np.linalg.norm(stack[..., 1:, :] - target[..., None, :], axis=-1)
    expected = np.full((B, T), N)
    for b, t in np.ndindex(B, T):
        expected[b, t] = next((n for n in range(2, N + 1) if d[b, t, n - 1] >= tau * d[b, t, n - 2]), N)
    labels = to_numpy(acm_losses.gate_labels(stack.astype("float32"), target.astype("float32"), tau))
    np.testing.assert_array_equal(labels, expected)
    assert expected[0, 0] == 2 and expected[0, 1] == N and len(set(expected.ravel())) > 2
    probs = ref.softmax(rng.standard_normal((B, T, N + 1)))
    ce = acm_losses.gate_cross_entropy(probs.astype("float32"), labels)
    picked = np.take_along_axis(probs, expected[..., None], -1)
    assert float(to_numpy(ce)) == pytest.approx(-np.log(picked).mean(), rel=1e-5)


def ref_fraction(choices, costs):
    used = sum(c * (h @ np.arange(h.shape[-1])).sum(1) for h, c in zip(choices, costs))
    return used / sum(c * (h.shape[-1] - 1) * h.shape[1] for h, c in zip(choices, costs))


def test_budget_entropy_and_diversity_losses_match_numpy():
    # rules out: budget without the absolute value or ignoring learner costs; entropy with
    # the wrong sign, over the whole batch instead of per image, or divided by log N
    # rather than log of the number of choices; diversity over distinct pairs only.
    choices = [one_hots(11), one_hots(12, tokens=6)]
    costs = [2.0, 0.5]
    fraction = ref_fraction(choices, costs)
    actual = acm_losses.budget_loss(choices, 0.7, learner_costs=costs)
    assert float(to_numpy(actual)) == pytest.approx(abs(fraction.mean() - 0.7), rel=1e-5)
    entropies = []
    for h in choices:
        a = h.sum(1) / h.shape[1]
        entropies.append(np.mean(np.where(a > 0, a * np.log(np.maximum(a, 1e-30)), 0).sum(-1)) / np.log(N + 1))
    assert float(to_numpy(acm_losses.entropy_loss(choices))) == pytest.approx(np.mean(entropies), rel=1e-5)
    b = ref_fraction(choices, [1.0, 1.0])
    expected = np.abs(b[:, None] - b[None, :]).mean()
    assert float(to_numpy(acm_losses.diversity_loss(choices))) == pytest.approx(expected, rel=1e-5)
    uniform = np.eye(N + 1, dtype="float32")[np.tile(np.arange(N + 1), 2)][None]
    assert float(to_numpy(acm_losses.entropy_loss(uniform))) == pytest.approx(-1.0, rel=1e-6)


# --------------------------------------------------------------------------- saving, errors
def test_keras_round_trip_and_configs(tmp_path):
    # rules out: a get_config missing mode / beta / capacity_factor / seed, weights not saved,
    # shapes that only work eagerly.
    z = keras.Input((T, D))
    gate = ACMGate(N + 1, seed=5)
    mlp = ACMMLP(D, M, N, mode="grouped", beta=0.5, capacity_factor=1.5, gelu_approximate=True)
    choice, probs = gate(z)
    model = keras.Model(z, mlp(z, choice, keras.ops.max(probs, axis=-1)))
    randomize_weights(model, seed=12, scale=0.5)
    x = rand(B, T, D)
    expected = to_numpy(model(x))
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, rtol=0, atol=1e-5)  # compiled: static shapes
    path = tmp_path / "acm.keras"
    model.save(path)
    np.testing.assert_array_equal(to_numpy(keras.saving.load_model(path)(x)), expected)
    assert config_roundtrip(mlp).get_config()["beta"] == 0.5
    assert config_roundtrip(gate).get_config()["seed"] == 5


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_learners=0), "num_learners"), (dict(num_learners=3), "num_learners"),
    (dict(num_learners="4"), "num_learners"), (dict(beta=0.0), "beta"), (dict(beta=1.5), "beta"),
    (dict(beta="0.5"), "beta"), (dict(mode="fast"), "mode"), (dict(capacity_factor=0.5), "capacity_factor"),
])
def test_bad_acm_arguments_are_named(kwargs, message):
    # rules out: silently accepted learner counts / budgets / modes.
    with pytest.raises(ValueError, match=message):
        ACMMLP(D, M, **kwargs)


def test_bad_call_arguments_are_named():
    # rules out: a (batch, tokens, N) one-hot read as counts 0..N-1; k out of range.
    layer, z = acm(), rand(B, T, D)
    with pytest.raises(ValueError, match="choices"):
        layer(z, np.zeros((B, T, N), "float32"))
    with pytest.raises(ValueError, match="mode"):
        layer(z, np.zeros((B, T), "int32"), mode="sparse")
    with pytest.raises(ValueError, match="`k`"):
        layer.output_at(z, N + 1)
    with pytest.raises(ValueError, match="num_choices"):
        ACMGate(1)
    with pytest.raises(ValueError, match="temperature"):
        ACMGate(N + 1, temperature=0)
    with pytest.raises(ValueError, match="tau"):
        acm_losses.gate_labels(rand(B, T, N + 1, D), rand(B, T, D), 0)
    with pytest.raises(ValueError, match="beta_target"):
        acm_losses.budget_loss(one_hots(0), 1.0)
    with pytest.raises(ValueError, match="learner_costs"):
        acm_losses.budget_loss([one_hots(0)], 0.5, learner_costs=[1.0, 2.0])
