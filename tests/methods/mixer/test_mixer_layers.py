"""MixerBlock, SparseMoE / SparseMixerBlock and the Re-represent layers (issue 26 items 2-4).

Every layer is compared with an independent float64 numpy version written
from the papers (Mixer Eq. 2-3, Sparse-MLP Eq. 4-11 and Algorithm 1); the
capacity reference is a plain Python loop over the choices.
"""

import math

import keras
import numpy as np
import pytest
from keras import ops
from scipy.special import erf

from keras_mone.methods.mixer.blocks import MixerBlock, SparseMixerBlock
from keras_mone.methods.mixer.re_represent import ReRepresent1, ReRepresent2
from keras_mone.methods.mixer.sparse_moe import SparseMoE, cv_squared, expert_capacity, importance_and_load

EPS = 1e-6


# ---------------------------------------------------------------- numpy side
def gelu(x, approximate=False):
    if approximate:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + erf(x / math.sqrt(2)))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def layer_norm(x, gamma, beta):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(-1, keepdims=True) + EPS) * gamma + beta


def np_weights(layer):
    return {v.path.split("/", 1)[1]: ops.convert_to_numpy(v).astype(np.float64) for v in layer.weights}


def np_mlp(x, w, prefix, approximate=False):
    hidden = gelu(x @ w[f"{prefix}/dense_0/kernel"] + w[f"{prefix}/dense_0/bias"], approximate)
    return hidden @ w[f"{prefix}/dense_1/kernel"] + w[f"{prefix}/dense_1/bias"]


def np_ln(x, w, name):
    return layer_norm(x, w[f"{name}/gamma"], w[f"{name}/beta"])


def np_mixer_block(x, w, approximate=False):
    t = np.swapaxes(np_ln(x, w, "layer_norm_0"), 1, 2)
    y1 = x + np.swapaxes(np_mlp(t, w, "token_mixing", approximate), 1, 2)
    return y1 + np_mlp(np_ln(y1, w, "layer_norm_1"), w, "channel_mixing", approximate)


def np_expert(x, w, e, prefix=""):
    hidden = gelu(x @ w[prefix + "kernel_0"][e] + w[prefix + "bias_0"][e])
    return hidden @ w[prefix + "kernel_1"][e] + w[prefix + "bias_1"][e]


def np_moe_dense(x, w, top_k, prefix=""):
    """Every expert on every item, combined by the (not renormalised) top-k gates."""
    probs = softmax(x @ w[prefix + "gate_kernel"])
    all_out = np.stack([np_expert(x, w, e, prefix) for e in range(probs.shape[-1])], axis=-2)
    kth = -np.sort(-probs, axis=-1)[..., top_k - 1 : top_k]
    gates = np.where(probs >= kth, probs, 0.0)
    return np.einsum("bte,btef->btf", gates, all_out)


def np_moe_capacity(x, w, top_k, capacity, prefix=""):
    """Loop over the choices: top-1 before top-2, within a rank by top-1 gate; full experts drop."""
    probs = softmax(x @ w[prefix + "gate_kernel"])
    batch, items, experts = probs.shape
    out, counts = np.zeros_like(x), np.zeros((batch, experts), int)
    for b in range(batch):
        choice = np.argsort(-probs[b], axis=-1, kind="stable")[:, :top_k]
        order = np.argsort(-probs[b, np.arange(items), choice[:, 0]], kind="stable")
        for r in range(top_k):
            for t in order:
                e = choice[t, r]
                if counts[b, e] < capacity:
                    counts[b, e] += 1
                    out[b, t] += probs[b, t, e] * np_expert(x[b, t], w, e, prefix)
    return out, counts


def np_importance_load(logits, noisy, top_k, noise_std):
    importance = softmax(logits).sum((0, 1))
    threshold = -np.sort(-noisy, axis=-1)[..., top_k - 1 : top_k]
    load = (0.5 * (1 - erf((threshold - logits) / noise_std / math.sqrt(2)))).sum((0, 1))
    return importance, load


def np_cv2(v):
    return v.var() / v.mean() ** 2


def np_re_represent(x, w, tokens_first):
    def tokens(z):
        z = np.swapaxes(z, 1, 2) @ w["token_projection/kernel"] + w["token_projection/bias"]
        return np.swapaxes(gelu(z), 1, 2)

    def channels(z):
        return gelu(z @ w["channel_projection/kernel"] + w["channel_projection/bias"])

    z = np_ln(x, w, "layer_norm_0")
    if tokens_first:
        return channels(np_ln(tokens(z), w, "layer_norm_1"))
    return tokens(np_ln(channels(z), w, "layer_norm_1"))


# -------------------------------------------------------------- helpers
def randomise(layer, seed=0, scale=0.5):
    rng = np.random.default_rng(seed)
    for v in layer.weights:
        v.assign(rng.normal(0.0, scale, v.shape).astype("float32"))


def inputs(shape, seed=1):
    return np.random.default_rng(seed).normal(0.0, 1.0, shape).astype("float32")


def close(actual, expected, tol=2e-4):
    np.testing.assert_allclose(ops.convert_to_numpy(actual), expected, rtol=tol, atol=tol)


def moe(x, top_k=2, num_experts=4, capacity_factor=1.25, seed=0, **kwargs):
    layer = SparseMoE(num_experts, 5, top_k, capacity_factor=capacity_factor, **kwargs)
    layer.build(x.shape)
    randomise(layer, seed)
    return layer, np_weights(layer)


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("approximate", [False, True])
def test_mixer_block_matches_numpy(approximate):
    # rules out: token MLP on channels (no transpose), a missing residual, one LayerNorm
    # shared by both sublayers, the `gelu_approximate` flag ignored
    x = inputs((2, 6, 10))
    block = MixerBlock(6, 10, 4, 12, gelu_approximate=approximate)
    block.build(x.shape)
    randomise(block)
    close(block(x), np_mixer_block(x.astype(np.float64), np_weights(block), approximate))


def test_mixer_block_names_map_to_the_npz_layout():
    # rules out: sublayer names a converter from `MixerBlock_i/...` cannot map one to one
    block = MixerBlock(6, 10, 4, 12)
    block.build((None, 6, 10))
    assert sorted(np_weights(block)) == sorted(
        f"{part}/{leaf}" for part, leaves in {
            "layer_norm_0": ("gamma", "beta"), "layer_norm_1": ("gamma", "beta"),
            "token_mixing/dense_0": ("kernel", "bias"), "token_mixing/dense_1": ("kernel", "bias"),
            "channel_mixing/dense_0": ("kernel", "bias"), "channel_mixing/dense_1": ("kernel", "bias"),
        }.items() for leaf in leaves
    )
    assert np_weights(block)["token_mixing/dense_0/kernel"].shape == (6, 4)  # (S, D_S) as the .npz


def test_gate_values_and_top_k_match_numpy():
    # rules out: noise at inference, a gate bias, top-k by logits of another axis
    x = inputs((2, 7, 6))
    layer, w = moe(x, top_k=2)
    logits, noisy, probs = layer.gate(x, training=False)
    expected = softmax(x.astype(np.float64) @ w["gate_kernel"])
    close(probs, expected, 1e-5)
    close(noisy, ops.convert_to_numpy(logits), 0)
    _, chosen = ops.top_k(probs, 2)
    np.testing.assert_array_equal(
        np.sort(ops.convert_to_numpy(chosen), -1), np.sort(np.argsort(-expected, -1)[..., :2], -1)
    )


@pytest.mark.parametrize("top_k", [1, 2])
def test_without_overflow_equals_every_expert_on_every_item(top_k):
    # rules out: top-k weights renormalised, items gathered into the wrong slots or
    # scattered back to the wrong items, an expert's weights applied to another expert
    x = inputs((2, 8, 6))
    layer, w = moe(x, top_k=top_k, capacity_factor=4 / top_k)
    y, stats = layer(x, return_stats=True)
    close(y, np_moe_dense(x.astype(np.float64), w, top_k))
    assert float(ops.convert_to_numpy(stats["overflow"])) == 0.0


@pytest.mark.parametrize("top_k, capacity_factor", [(1, 1.0), (2, 0.5), (2, 1.25)])
def test_capacity_and_priority_match_the_loop_reference(top_k, capacity_factor):
    # rules out: a per-batch capacity, top-2 choices served before other items' top-1,
    # items served in position order instead of by gate value, loads above capacity
    x = inputs((3, 12, 6), seed=top_k)
    layer, w = moe(x, top_k=top_k, capacity_factor=capacity_factor)
    capacity = layer.capacity(12)
    assert capacity == math.ceil(capacity_factor * top_k * 12 / 4)
    y, stats = layer(x, return_stats=True)
    expected, counts = np_moe_capacity(x.astype(np.float64), w, top_k, capacity)
    close(y, expected)
    np.testing.assert_array_equal(ops.convert_to_numpy(stats["counts"]), counts)
    assert counts.max() <= capacity
    overflow = 1 - counts.sum() / (3 * 12 * top_k)
    assert float(ops.convert_to_numpy(stats["overflow"])) == pytest.approx(overflow)


def test_loads_never_exceed_capacity_in_training():
    # rules out: the capacity applied before the noise or only at inference
    x = inputs((4, 16, 6))
    layer, _ = moe(x, top_k=2, capacity_factor=0.5, seed=3)
    for _ in range(3):
        _, stats = layer(x, training=True, return_stats=True)
        counts = ops.convert_to_numpy(stats["counts"])
        assert counts.max() <= layer.capacity(16) == 4
        overflow = float(ops.convert_to_numpy(stats["overflow"]))
        assert counts.sum() == pytest.approx(4 * 16 * 2 * (1 - overflow))


def test_items_whose_choices_all_overflow_add_zero():
    # rules out: dropped items still weighted by their gate, or kept by position rather than gate
    x = np.zeros((1, 8, 4), "float32")
    x[0, :, 0] = [0.2, 0.9, 0.1, 0.8, 0.3, 0.7, 0.4, 0.6]  # all route to expert 0
    layer, w = moe(x, top_k=1, capacity_factor=1.25)  # capacity ceil(1.25 * 8 / 4) = 3
    layer.gate_kernel.assign(np.array([[5.0, 0, 0, 0]] + [[0.0] * 4] * 3, "float32"))
    w = np_weights(layer)
    y = ops.convert_to_numpy(layer(x))
    kept = [1, 3, 5]  # the three largest gates
    dropped = [i for i in range(8) if i not in kept]
    assert np.all(y[0, dropped] == 0.0)
    probs = softmax(x.astype(np.float64) @ w["gate_kernel"])
    for t in kept:
        close(y[0, t], probs[0, t, 0] * np_expert(x[0, t].astype(np.float64), w, 0))


def test_aux_loss_matches_numpy():
    # rules out: importance from the noisy softmax, the threshold from the clean logits in
    # training, Shazeer's threshold excluding the expert itself, std with ddof=1, CV instead of CV^2
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 1, (2, 9, 4))
    noisy = logits + rng.normal(0, 0.25, logits.shape)
    importance, load = importance_and_load(
        ops.convert_to_tensor(logits, "float32"), ops.convert_to_tensor(noisy, "float32"), 2, 0.25
    )
    expected_importance, expected_load = np_importance_load(logits, noisy, 2, 0.25)
    close(importance, expected_importance, 1e-4)
    close(load, expected_load, 1e-4)
    close(cv_squared(ops.convert_to_tensor(expected_load, "float32")), np_cv2(expected_load), 1e-5)
    # the layer, at inference (threshold from the clean logits), with a non-default weight
    x = inputs((2, 9, 6))
    layer, w = moe(x, top_k=2, aux_loss_weight=0.3, seed=2)
    _, stats = layer(x, return_stats=True)
    logits = x.astype(np.float64) @ w["gate_kernel"]
    imp, ld = np_importance_load(logits, logits, 2, 0.25)
    close(stats["importance"], imp, 1e-4)
    close(stats["load"], ld, 1e-4)
    close(stats["aux_loss"], 0.3 * (np_cv2(imp) + np_cv2(ld)) / 2, 1e-5)


def test_noise_only_in_training():
    # rules out: noise at inference, noise that ignores the seed, noise with `noise=False`
    x = inputs((2, 8, 6))
    a, _ = moe(x)
    outputs = {}
    for seed in (1, 2):
        layer = SparseMoE(4, 5, 2, seed=seed)
        layer.build(x.shape)
        layer.set_weights(a.get_weights())
        outputs[seed] = [ops.convert_to_numpy(layer(x, training=t)) for t in (False, False, True)]
    np.testing.assert_array_equal(outputs[1][0], outputs[1][1])
    np.testing.assert_array_equal(outputs[1][0], outputs[2][0])
    assert not np.allclose(outputs[1][2], outputs[2][2])
    assert not np.allclose(outputs[1][2], outputs[1][0])
    quiet = SparseMoE(4, 5, 2, noise=False, seed=1)
    quiet.build(x.shape)
    quiet.set_weights(a.get_weights())
    np.testing.assert_array_equal(ops.convert_to_numpy(quiet(x, training=True)), outputs[1][0])


@pytest.mark.parametrize("channel_experts", [4, 0])
def test_sparse_mixer_block_matches_numpy(channel_experts):
    # rules out: MoE_S routing tokens instead of channel columns, a missing residual (overflow
    # items would vanish), stats of one sublayer only, Sparse-S's dense MoE_C not dense
    x = inputs((2, 8, 6))
    block = SparseMixerBlock(8, 6, 4, 5, channel_experts, 7, token_top_k=1, channel_top_k=2,
                             capacity_factor=1.0, aux_loss_weight=0.01)
    block.build(x.shape)
    randomise(block)
    w, x64 = np_weights(block), x.astype(np.float64)
    token_w = {k.split("/", 1)[1]: v for k, v in w.items() if k.startswith("token_mixing/")}
    t = np.swapaxes(np_ln(x64, w, "layer_norm_0"), 1, 2)  # (batch, C', S'): items are channels
    mixed, _ = np_moe_capacity(t, token_w, 1, expert_capacity(6, 4, 1, 1.0))
    y1 = x64 + np.swapaxes(mixed, 1, 2)
    z = np_ln(y1, w, "layer_norm_1")
    if channel_experts:
        channel_w = {k.split("/", 1)[1]: v for k, v in w.items() if k.startswith("channel_mixing/")}
        mixed, _ = np_moe_capacity(z, channel_w, 2, expert_capacity(8, 4, 2, 1.0))
    else:
        mixed = np_mlp(z, w, "channel_mixing")
    y, stats = block(x, return_stats=True)
    close(y, y1 + mixed)
    expected_aux = 0.0
    for key, items_w, k in (("token_mixing", token_w, 1), ("channel_mixing", None, 2)):
        if key not in stats:
            continue
        inp = t if key == "token_mixing" else z
        gw = items_w or channel_w
        logits = inp @ gw["gate_kernel"]
        imp, ld = np_importance_load(logits, logits, k, 0.25)
        expected_aux += 0.01 * (np_cv2(imp) + np_cv2(ld)) / 2
    assert ("channel_mixing" in stats) == bool(channel_experts)
    close(stats["aux_loss"], expected_aux, 1e-5)


@pytest.mark.parametrize("cls, tokens_first", [(ReRepresent1, True), (ReRepresent2, False)])
def test_re_represent_matches_numpy(cls, tokens_first):
    # rules out: RR2 in RR1's order, the second LayerNorm missing, a residual around the layer
    shape = (2, 6, 8) if tokens_first else (2, 12, 4)
    out = (12, 4) if tokens_first else (6, 8)
    layer = cls(shape[1], shape[2], *out)
    x = inputs(shape)
    layer.build(x.shape)
    randomise(layer)
    y = layer(x)
    assert tuple(y.shape) == (2,) + out
    close(y, np_re_represent(x.astype(np.float64), np_weights(layer), tokens_first))


def test_round_trip_through_keras_file(tmp_path):
    # rules out: a config key missing from get_config, an unregistered layer, weights
    # restored to the wrong sublayer
    inp = keras.Input((8, 6))
    x = MixerBlock(8, 6, 4, 12, name="mixer")(inp)
    x = ReRepresent1(8, 6, 12, 4, name="rr1")(x)
    x, stats = SparseMixerBlock(12, 4, 4, 6, 2, 5, capacity_factor=1.5, seed=3, name="sparse")(
        x, return_stats=True
    )
    x = ReRepresent2(12, 4, 8, 6, name="rr2")(x)
    x = SparseMoE(3, 4, 2, capacity_factor=0.75, noise=False, aux_loss_weight=0.02, name="moe")(x)
    model = keras.Model(inp, [x, stats["aux_loss"]])
    for layer in model.layers[1:]:
        randomise(layer, scale=0.3)
    data = inputs((2, 8, 6))
    expected = [ops.convert_to_numpy(t) for t in model(data)]
    path = tmp_path / "mixer.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    for a, b in zip(loaded(data), expected):
        close(a, b, 1e-5)
    for name in ("mixer", "rr1", "sparse", "rr2", "moe"):
        assert loaded.get_layer(name).get_config() == model.get_layer(name).get_config()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_experts": 0}, "`num_experts` must be an int >= 1"),
        ({"num_experts": 2.5}, "`num_experts` must be an int >= 1"),
        ({"num_experts": "4"}, "`num_experts` must be an int >= 1"),
        ({"num_experts": 2, "top_k": 3}, "`top_k` (3) must not exceed `num_experts` (2)"),
        ({"top_k": 0}, "`top_k` must be an int >= 1"),
        ({"capacity_factor": 0.0}, "`capacity_factor` must lie in (0, inf)"),
        ({"capacity_factor": -1.0}, "`capacity_factor` must lie in (0, inf)"),
        ({"expert_hidden_dim": 0}, "`expert_hidden_dim` must be an int >= 1"),
    ],
)
def test_bad_sparse_moe_arguments(kwargs, message):
    # rules out: a silent fallback (K clipped to N_E, capacity 0 dropping every item)
    args = {"num_experts": 4, "expert_hidden_dim": 5, "top_k": 1, **kwargs}
    with pytest.raises(ValueError) as info:
        SparseMoE(**args)
    assert message in str(info.value)


def test_bad_block_arguments_name_the_block_argument():
    # rules out: errors that name SparseMoE's argument instead of the block's, wrong shapes accepted
    too_many = "`channel_top_k` \\(3\\) must not exceed `channel_num_experts` \\(2\\)"
    with pytest.raises(ValueError, match=too_many):
        SparseMixerBlock(8, 6, 4, 5, 2, 7, channel_top_k=3)
    with pytest.raises(ValueError, match="`token_num_experts` must be an int >= 0"):
        SparseMixerBlock(8, 6, -1, 5, 2, 7)
    with pytest.raises(ValueError, match="num_tokens=8"):
        MixerBlock(8, 6, 4, 12)(inputs((1, 7, 6)))
    with pytest.raises(ValueError, match="hidden_dim=6"):
        ReRepresent1(8, 6, 12, 4)(inputs((1, 8, 5)))


@pytest.mark.parametrize("loss_weights", [(1.0, 0.0), (0.0, 1.0)], ids=["output", "aux"])
def test_fit_trains_the_gates(loss_weights):
    # rules out: gates that carry no gradient (e.g. one-hot dispatch weights), an aux loss
    # detached from the gate kernels, shapes that break the compiled train step
    inp = keras.Input((8, 6))
    y, stats = SparseMixerBlock(
        8, 6, 2, 4, 2, 5, capacity_factor=1.0, aux_loss_weight=10.0, seed=0, name="sparse"
    )(inp, return_stats=True)
    pooled = ops.mean(y, axis=1)
    aux = ops.zeros_like(pooled[:, :1]) + stats["aux_loss"]
    model = keras.Model(inp, [keras.layers.Dense(3, name="head")(pooled), aux])
    model.compile(
        optimizer=keras.optimizers.SGD(0.5), loss=["mse", lambda _, pred: ops.mean(pred, axis=-1)],
        loss_weights=list(loss_weights),
    )
    block = model.get_layer("sparse")
    sublayers = (block.token_mixing, block.channel_mixing)
    randomise(block, scale=0.3)
    before = [ops.convert_to_numpy(layer.gate_kernel) for layer in sublayers]
    data = inputs((4, 8, 6))
    model.fit(data, [inputs((4, 3), seed=2), np.zeros((4, 1), "float32")], epochs=1, batch_size=4, verbose=0)
    for old, layer in zip(before, sublayers):
        new = ops.convert_to_numpy(layer.gate_kernel)
        assert np.all(np.isfinite(new)) and np.abs(new - old).max() > 1e-4
