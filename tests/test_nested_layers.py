"""Nested layers against the numpy reference of App. A.1 Eq. 5-7 and Eq. 1."""

import math

import keras
import numpy as np
import numpy_reference as ref
import pytest
from conftest import (
    BACKEND,
    assert_f32_close,
    config_roundtrip,
    f32_tolerance,
    gradients,
    max_abs_diff,
    randomize_weights,
    to_numpy,
)

from keras_mone import layers
from keras_mone.data import augment
from keras_mone.exports import exported
from keras_mone.layers.activations import gelu, rational_erf
from keras_mone.layers.attention import multi_head_attention

D, HEADS, MLP = 32, 4, 64
WIDTHS = [4, 8, 16, 32]  # the four nested experts of D = 32
SIZES = [5, 4, 4, 3]  # tokens per group in the mixed-width calls

# Float32 layers against the float64 reference: see conftest.F32_ULPS
# (measured <= 4 ulps of max|value| for single layers). ATOL is for float32 vs
# float32 of the same maths in another summation order (sliced input vs full
# input, permuted groups): outputs are O(1-10), observed differences <= 2e-6.
ATOL = 1e-5


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def weights_of(layer):
    return {v.path.split("/", 1)[1] if "/" in v.path else v.path: to_numpy(v) for v in layer.weights}


def built(layer, shape, seed=0):
    layer.build(shape)
    randomize_weights(layer, seed=seed)
    return layer


def attention_params(layer):
    w = {v.path: to_numpy(v) for v in layer.weights}
    get = lambda suffix: next(val for path, val in w.items() if path.endswith(suffix))  # noqa: E731
    return (get("qkv/kernel"), get("qkv/bias"), get("out/kernel"), get("out/bias"))


def block_params(block):
    w = {v.path: to_numpy(v) for v in block.weights}
    get = lambda suffix: next(val for path, val in w.items() if path.endswith(suffix))  # noqa: E731
    names = {
        "norm1_gamma": "norm1/gamma", "norm1_beta": "norm1/beta",
        "qkv_kernel": "qkv/kernel", "qkv_bias": "qkv/bias",
        "out_kernel": "out/kernel", "out_bias": "out/bias",
        "norm2_gamma": "norm2/gamma", "norm2_beta": "norm2/beta",
        "fc1_kernel": "fc1/kernel", "fc1_bias": "fc1/bias",
        "fc2_kernel": "fc2/kernel", "fc2_bias": "fc2/bias",
    }
    params = {k: get(v).astype(np.float64) for k, v in names.items()}
    params["num_heads"] = block.num_heads
    return params


def mixed_groups(seed=0):
    """Token groups (batch 2, k_j tokens, D) and the per-token widths of their concatenation."""
    groups = [rand(2, k, D, seed=seed + j) for j, k in enumerate(SIZES)]
    per_token = np.concatenate([np.full((2, k), w) for k, w in zip(SIZES, WIDTHS)], axis=1)
    return groups, per_token


# --------------------------------------------------------------------------
# NestedDense (Eq. 7)
# --------------------------------------------------------------------------
class TestNestedDense:
    def make(self):
        return built(layers.NestedDense(48), (None, None, D))

    def test_full_width_is_dense(self):
        layer = self.make()
        x = rand(2, 5, D)
        w = weights_of(layer)
        expected = x.astype(np.float64) @ w["kernel"] + w["bias"]
        assert_f32_close(to_numpy(layer(x)), expected)

    @pytest.mark.parametrize("width", [4, 8, 16])
    def test_sliced_in_projection(self, width):
        layer = self.make()
        x = rand(2, 5, D)
        w = weights_of(layer)
        expected = ref.nested_dense(x, w["kernel"], w["bias"], in_width=width)
        out = to_numpy(layer(x, in_width=width))
        assert out.shape == (2, 5, 48)
        assert_f32_close(out, expected)
        # Only the first `width` features are read: scrambling the rest changes nothing.
        x2 = x.copy()
        x2[..., width:] = rand(2, 5, D - width, seed=7) * 100.0
        np.testing.assert_array_equal(to_numpy(layer(x2, in_width=width)), out)
        # ...and an input already sliced to `width` features is accepted.
        np.testing.assert_allclose(to_numpy(layer(x[..., :width], in_width=width)), out, rtol=0, atol=ATOL)

    @pytest.mark.parametrize("width", [4, 16])
    def test_sliced_out_projection_is_zero_padded(self, width):
        layer = self.make()
        x = rand(2, 5, D)
        w = weights_of(layer)
        out = to_numpy(layer(x, out_width=width))
        assert out.shape == (2, 5, 48)
        assert np.all(out[..., width:] == 0.0)
        expected = x.astype(np.float64) @ w["kernel"][:, :width] + w["bias"][:width]
        assert_f32_close(out[..., :width], expected)
        unpadded = to_numpy(layer(x, out_width=width, pad_output=False))
        assert unpadded.shape == (2, 5, width)
        np.testing.assert_array_equal(unpadded, out[..., :width])

    def test_both_slices(self):
        layer = self.make()
        x = rand(2, 5, D)
        w = weights_of(layer)
        expected = ref.nested_dense(x, w["kernel"], w["bias"], in_width=8, out_width=12)
        assert_f32_close(to_numpy(layer(x, in_width=8, out_width=12)), expected)

    @pytest.mark.parametrize("kwargs, name", [
        (dict(in_width=0), "in_width"), (dict(in_width=D + 1), "in_width"),
        (dict(out_width=0), "out_width"), (dict(out_width=49), "out_width"),
    ])
    def test_bad_width(self, kwargs, name):
        layer = self.make()
        with pytest.raises(ValueError, match=name):
            layer(rand(2, 5, D), **kwargs)

    def test_wrong_feature_count(self):
        layer = self.make()
        with pytest.raises(ValueError, match="input features"):
            layer(rand(2, 5, 12), in_width=8)


# --------------------------------------------------------------------------
# MoNEAttention (Eq. 5)
# --------------------------------------------------------------------------
class TestMoNEAttention:
    def make(self):
        return built(layers.MoNEAttention(D, HEADS), (None, None, D), seed=1)

    def test_full_width_matches_reference(self):
        layer = self.make()
        x = rand(2, 7, D)
        expected = ref.attention(x, D, *attention_params(layer), HEADS)
        assert_f32_close(to_numpy(layer(x)), expected)

    def test_mixed_widths_match_reference(self):
        layer = self.make()
        groups, per_token = mixed_groups()
        outs = layer(groups, widths=WIDTHS)
        assert isinstance(outs, list) and len(outs) == len(groups)
        expected = ref.attention(np.concatenate(groups, axis=1), per_token, *attention_params(layer), HEADS)
        got = np.concatenate([to_numpy(o) for o in outs], axis=1)
        assert got.shape == expected.shape
        assert_f32_close(got, expected)
        # Out-projections of width-d tokens are exactly zero beyond d.
        for out, width in zip(outs, WIDTHS):
            assert np.all(to_numpy(out)[..., width:] == 0.0)

    def test_tokens_only_read_their_first_d_features(self):
        layer = self.make()
        groups, _ = mixed_groups()
        before = [to_numpy(o) for o in layer(groups, widths=WIDTHS)]
        changed = [g.copy() for g in groups]
        for g, width in zip(changed, WIDTHS):
            g[..., width:] += 50.0 * rand(*g[..., width:].shape, seed=width)
        after = [to_numpy(o) for o in layer(changed, widths=WIDTHS)]
        for b, a in zip(before, after):  # every group, since keys/values are unchanged too
            np.testing.assert_array_equal(a, b)

    def test_widths_beyond_D_are_read(self):
        # Control for the test above: a full-width group *does* see all features.
        layer = self.make()
        x = rand(2, 4, D)
        x2 = x.copy()
        x2[..., 16:] += 1.0
        assert max_abs_diff(to_numpy(layer([x], widths=[D])[0]), to_numpy(layer([x2], widths=[D])[0])) > 1e-3

    def test_group_order_does_not_matter(self):
        # Attention is over all tokens of all groups: permuting groups permutes outputs.
        layer = self.make()
        groups, _ = mixed_groups()
        outs = [to_numpy(o) for o in layer(groups, widths=WIDTHS)]
        rev = [to_numpy(o) for o in layer(groups[::-1], widths=WIDTHS[::-1])][::-1]
        for a, b in zip(outs, rev):
            assert max_abs_diff(a, b) <= ATOL

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="num_heads"):
            layers.MoNEAttention(30, 4)
        layer = self.make()
        groups, _ = mixed_groups()
        with pytest.raises(ValueError, match="widths"):
            layer(groups, widths=WIDTHS[:3])
        with pytest.raises(ValueError, match="widths"):
            layer(groups, widths=[4, 8, 16, 64])


# --------------------------------------------------------------------------
# NestedMLP (Eq. 6)
# --------------------------------------------------------------------------
class TestNestedMLP:
    def make(self):
        return built(layers.NestedMLP(D, MLP), (None, None, D), seed=2)

    def params(self, layer):
        w = {v.path.split("/", 1)[1]: to_numpy(v) for v in layer.weights}
        return w["fc1/kernel"], w["fc1/bias"], w["fc2/kernel"], w["fc2/bias"]

    @pytest.mark.parametrize("width", WIDTHS)
    def test_matches_reference(self, width):
        layer = self.make()
        x = rand(2, 5, D)
        expected = ref.mlp(x, width, *self.params(layer))
        out = to_numpy(layer(x, width=width))
        assert out.shape == (2, 5, D)
        assert_f32_close(out, expected)
        assert np.all(out[..., width:] == 0.0)
        x2 = x.copy()
        x2[..., width:] = 100.0
        np.testing.assert_array_equal(to_numpy(layer(x2, width=width)), out)

    def test_exact_gelu(self):
        # tanh-approximate GELU differs from the erf form by up to ~1e-3 here.
        layer = self.make()
        x = 2.0 * rand(2, 5, D)
        fc1k, fc1b, fc2k, fc2b = self.params(layer)
        h = x.astype(np.float64) @ fc1k + fc1b
        tanh_gelu = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
        approx = tanh_gelu @ fc2k + fc2b
        exact = ref.mlp(x, D, fc1k, fc1b, fc2k, fc2b)
        out = to_numpy(layer(x))
        assert max_abs_diff(exact, approx) > 5 * f32_tolerance(exact)  # the check below tells them apart
        assert_f32_close(out, exact)

    def test_unpadded_output(self):
        layer = self.make()
        x = rand(2, 5, D)
        out = to_numpy(layer(x, width=8, pad_output=False))
        assert out.shape == (2, 5, 8)
        np.testing.assert_allclose(out, to_numpy(layer(x, width=8))[..., :8], rtol=0, atol=ATOL)


# --------------------------------------------------------------------------
# ViTBlock (Eq. 1 with pre-LayerNorm)
# --------------------------------------------------------------------------
class TestViTBlock:
    def make(self, routed):
        block = built(layers.ViTBlock(D, HEADS, MLP, routed=routed), (None, None, D), seed=3)
        return block

    def test_dense_block_matches_reference(self):
        block = self.make(routed=False)
        assert block.alpha is None
        x = rand(2, 7, D)
        expected = ref.block(x, D, block_params(block))
        assert_f32_close(to_numpy(block(x)), expected)

    def test_routed_mixed_groups_with_gates_match_reference(self):
        block = self.make(routed=True)
        alpha = float(to_numpy(block.alpha))
        assert 0.2 <= alpha <= 0.8  # randomize_weights set it; the gate term is active
        groups, per_token = mixed_groups(seed=10)
        gates = [np.random.default_rng(j).uniform(0, 1, (2, k)).astype("float32") for j, k in enumerate(SIZES)]
        outs = block(groups, widths=WIDTHS, gates=gates)
        got = np.concatenate([to_numpy(o) for o in outs], axis=1)
        expected = ref.block(
            np.concatenate(groups, axis=1), per_token, block_params(block),
            gates=np.concatenate(gates, axis=1), alpha=alpha,
        )
        assert_f32_close(got, expected)
        # Without the gate (alpha * r + 1 -> 1) the result differs: the gate is applied.
        ungated = ref.block(np.concatenate(groups, axis=1), per_token, block_params(block))
        assert max_abs_diff(expected, ungated) > 100 * ATOL

    def test_none_gate_for_a_group(self):
        block = self.make(routed=True)
        alpha = float(to_numpy(block.alpha))
        groups, per_token = mixed_groups(seed=20)
        gates = [None, np.full((2, SIZES[1]), 0.5, "float32"), None, np.full((2, SIZES[3]), 0.25, "float32")]
        got = np.concatenate([to_numpy(o) for o in block(groups, widths=WIDTHS, gates=gates)], axis=1)
        # A None gate means factor 1, i.e. alpha * r + 1 = 1 -> r = 0 in the reference.
        dense_gates = np.concatenate(
            [np.zeros((2, k)) if g is None else g for g, k in zip(gates, SIZES)], axis=1
        )
        expected = ref.block(np.concatenate(groups, axis=1), per_token, block_params(block), gates=dense_gates, alpha=alpha)
        assert_f32_close(got, expected)

    def test_features_beyond_d_pass_through_unchanged(self):
        # Both branch updates of a width-d token are zero-padded beyond d, so the
        # block leaves features [d:] exactly as they were (x + 0 == x). (LayerNorm
        # runs over all D features, so the *first* d outputs do depend on them.)
        block = self.make(routed=True)
        groups, _ = mixed_groups(seed=30)
        outs = block(groups, widths=WIDTHS, gates=None)
        for g, o, width in zip(groups, outs, WIDTHS):
            np.testing.assert_array_equal(to_numpy(o)[..., width:], g[..., width:])

    def test_drop_path_drops_whole_examples_across_groups(self):
        # Stochastic depth drops a residual branch for a whole example. With the
        # tokens of one example split over expert groups, every group of that
        # example must see the same keep/drop decision. The MLP branch is zeroed
        # so that out - in is exactly the (dropped or kept) attention branch.
        block = layers.ViTBlock(D, HEADS, MLP, routed=True, drop_path_rate=0.5)
        block.build((None, None, D))
        randomize_weights(block, seed=13)
        block.mlp.fc2.kernel.assign(np.zeros((MLP, D), "float32"))
        block.mlp.fc2.bias.assign(np.zeros((D,), "float32"))
        groups = [rand(64, 3, D, seed=1), rand(64, 4, D, seed=2)]
        outs = block(groups, widths=[8, D], training=True)
        dropped = [np.all(to_numpy(o) == g, axis=(1, 2)) for o, g in zip(outs, groups)]
        assert 10 < dropped[0].sum() < 54  # about half the examples (Binomial(64, 0.5))
        np.testing.assert_array_equal(dropped[0], dropped[1], err_msg="groups of one example dropped independently")

    def test_gates_need_a_routed_block(self):
        block = self.make(routed=False)
        groups, _ = mixed_groups()
        gates = [np.ones((2, k), "float32") for k in SIZES]
        with pytest.raises(ValueError, match="routed"):
            block(groups, widths=WIDTHS, gates=gates)

    def test_alpha_starts_at_zero_and_is_constrained(self):
        block = layers.ViTBlock(D, HEADS, MLP, routed=True)
        block.build((None, None, D))
        assert float(to_numpy(block.alpha)) == 0.0
        clip = block.alpha.constraint
        assert isinstance(clip, layers.HalfOpenUnitInterval)
        out = to_numpy(clip(keras.ops.convert_to_tensor(np.array([-1.0, 0.0, 0.5, 1.0, 3.0], "float32"))))
        assert out[0] == 0.0 and out[1] == 0.0 and out[2] == 0.5
        assert 0.999 < out[3] < 1.0 and 0.999 < out[4] < 1.0


# --------------------------------------------------------------------------
# PatchEmbedding, DropPath, routers
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_alpha_constraint_keeps_low_precision_weights_below_one(dtype):
    # With dtype="bfloat16" the alpha variable itself is bfloat16; 1 - 1e-6
    # rounds to 1.0 there, so the clip must use a value representable below 1.
    clip = layers.HalfOpenUnitInterval()
    out = clip(keras.ops.cast(np.array([3.0, 1.0, 0.5, -1.0], "float32"), dtype))
    out = to_numpy(keras.ops.cast(out, "float32"))
    assert np.all(out < 1.0) and np.all(out >= 0.0), out
    assert out[0] > 0.99 and out[2] == 0.5 and out[3] == 0.0


class TestPatchEmbedding:
    @pytest.mark.parametrize("use_class_token", [False, True])
    def test_matches_reference(self, use_class_token):
        layer = layers.PatchEmbedding(16, 4, D, num_channels=2, use_class_token=use_class_token)
        layer.build((None, 16, 16, 2))
        randomize_weights(layer, seed=4)
        assert layer.num_tokens == 16 + int(use_class_token)
        w = weights_of(layer)
        x = rand(2, 16, 16, 2)
        expected = ref.patch_embedding(
            x, w["projection/kernel"], w["projection/bias"],
            w.get("class_token") if use_class_token else None, w["position_embedding"], 4,
        )
        assert_f32_close(to_numpy(layer(x)), expected)

    def test_errors_name_the_argument(self):
        with pytest.raises(ValueError, match="`image_size`.*`patch_size`"):
            layers.PatchEmbedding(30, 8, D)
        layer = layers.PatchEmbedding(16, 4, D, num_channels=3)
        layer.build((None, 16, 16, 3))
        with pytest.raises(ValueError, match="num_channels"):
            layer(rand(1, 16, 16, 1))
        with pytest.raises(ValueError, match="image_size"):
            layer(rand(1, 20, 20, 3))


class TestDropPath:
    def test_identity_at_inference_and_per_example_in_training(self):
        layer = layers.DropPath(0.5, seed=3)
        x = np.ones((64, 3, 4), "float32")
        np.testing.assert_array_equal(to_numpy(layer(x)), x)
        np.testing.assert_array_equal(to_numpy(layer(x, training=False)), x)
        out = to_numpy(layer(x, training=True))
        per_example = out.reshape(64, -1)
        # each example is either dropped (0) or kept and scaled by 1 / (1 - rate)
        assert np.all((per_example == 0.0).all(axis=1) | (per_example == 2.0).all(axis=1))
        kept = (per_example == 2.0).all(axis=1).sum()
        assert 10 < kept < 54  # Binomial(64, 0.5): outside this range has p < 1e-7

    def test_bad_rate(self):
        with pytest.raises(ValueError, match="rate"):
            layers.DropPath(1.0)


class TestRouters:
    def test_router_is_softmax_of_dense(self):
        router = layers.Router(4)
        router.build((None, None, D))
        randomize_weights(router, seed=5, scale=1.0)
        w = weights_of(router)
        x = rand(2, 6, D)
        probs = to_numpy(router(x))
        assert probs.dtype == np.float32
        expected = ref.softmax(x.astype(np.float64) @ w["dense/kernel"] + w["dense/bias"])
        assert max_abs_diff(probs, expected) <= 1e-6  # probabilities in [0, 1]

    def test_router_float32_under_bfloat16(self):
        router = layers.Router(4, dtype="bfloat16")
        router.build((None, None, D))
        probs = router(keras.ops.cast(rand(2, 6, D), "bfloat16"))
        assert keras.backend.standardize_dtype(probs.dtype) == "float32"
        np.testing.assert_allclose(to_numpy(probs).sum(-1), 1.0, atol=1e-6)

    def test_random_router(self):
        router = layers.RandomRouter(4, seed=1)
        probs = to_numpy(router(rand(3, 5, D)))
        assert probs.shape == (3, 5, 4) and probs.dtype == np.float32
        assert probs.min() >= 0.0 and probs.max() < 1.0
        assert len(np.unique(probs)) > 50  # not constant
        assert router.weights == [] or all(not v.trainable for v in router.weights)


# --------------------------------------------------------------------------
# get_config round trip of every public layer
# --------------------------------------------------------------------------
PUBLIC_LAYERS = {
    "NestedDense": lambda: layers.NestedDense(24, use_bias=False, bias_initializer="ones"),
    "MoNEAttention": lambda: layers.MoNEAttention(D, HEADS, use_bias=False, dropout_rate=0.1),
    "NestedMLP": lambda: layers.NestedMLP(D, MLP, dropout_rate=0.2),
    "ViTBlock": lambda: layers.ViTBlock(D, HEADS, MLP, routed=True, drop_path_rate=0.1, layer_norm_epsilon=1e-5),
    "PatchEmbedding": lambda: layers.PatchEmbedding(
        (16, 24), 8, D, num_channels=1, use_class_token=True, use_position_embedding=False
    ),
    "DropPath": lambda: layers.DropPath(0.25, seed=7),
    "Router": lambda: layers.Router(3),
    "RandomRouter": lambda: layers.RandomRouter(5, seed=11),
    "ExpertPreferredRouting": lambda: layers.ExpertPreferredRouting(
        3, 0.4, capacity_method="greedy", beta=5.0, delta=3.0
    ),
    "TubeletEmbedding": lambda: layers.TubeletEmbedding(
        6, (16, 24), 8, D, tubelet_size=3, num_channels=1, use_class_token=False
    ),
    "SequenceEncoder": lambda: layers.SequenceEncoder(
        5, D, 2, HEADS, MLP, use_class_token=False, drop_path_rate=0.1, layer_norm_epsilon=1e-5
    ),
    "InceptionCrop": lambda: augment.InceptionCrop(12, 10, area_range=(0.2, 0.9), seed=3),
    "RolledMixUp": lambda: augment.RolledMixUp(alpha=0.5, seed=4),
    "ACMMLP": lambda: layers.ACMMLP(D, MLP, num_learners=2, mode="grouped", beta=0.4, dropout_rate=0.1),
    "ACMGate": lambda: layers.ACMGate(3, hidden_units=8, temperature=0.5, seed=2),
    "ACMLinear": lambda: layers.ACMLinear(D, num_learners=2, rank=4, beta=0.6),
    "MlpBlock": lambda: layers.MlpBlock(D, 12, gelu_approximate=True),
    "MixerBlock": lambda: layers.MixerBlock(6, D, 5, 12, layer_norm_epsilon=1e-5),
    "SparseMixerBlock": lambda: layers.SparseMixerBlock(
        6, D, 2, 8, 0, 16, capacity_factor=2.0, aux_loss_weight=0.02, seed=3
    ),
    "SparseMoE": lambda: layers.SparseMoE(3, 8, 2, capacity_factor=1.5, noise=False, seed=5),
    "ReRepresent1": lambda: layers.ReRepresent1(6, D, 12, 4),
    "ReRepresent2": lambda: layers.ReRepresent2(12, 4, 6, D),
}


def test_every_public_layer_is_covered():
    # A family's layers are exported into keras_mone.layers from its folder (keras_mone.exports).
    public = {name for module in (layers, augment) for name in {*module.__all__, *exported(module.__name__)}
              if isinstance(getattr(module, name), type) and issubclass(getattr(module, name), keras.layers.Layer)}
    assert public == set(PUBLIC_LAYERS)


@pytest.mark.parametrize("name", sorted(PUBLIC_LAYERS))
def test_get_config_round_trip(name):
    layer = PUBLIC_LAYERS[name]()
    clone = config_roundtrip(layer)
    config = layer.get_config()
    # the non-default constructor arguments survive
    for key, value in config.items():
        if key in ("name", "trainable", "dtype"):
            continue
        assert clone.get_config()[key] == value
    # ...and are really used by the clone, not just echoed
    for attr in ("units", "use_bias", "dropout_rate", "routed", "drop_path_rate", "layer_norm_epsilon",
                 "use_class_token", "num_channels", "rate", "seed", "num_experts", "capacity_method",
                 "effective_capacity", "beta", "delta", "capacities", "num_frames", "tubelet_size",
                 "image_size", "sequence_length", "depth", "area_range", "alpha", "num_learners", "mode",
                 "temperature", "top_k", "capacity_factor", "aux_loss_weight", "noise", "gelu_approximate",
                 "num_tokens", "output_tokens", "output_dim", "use_position_embedding"):
        if hasattr(layer, attr):
            assert getattr(clone, attr) == getattr(layer, attr), attr


def test_half_open_unit_interval_serialises():
    constraint = layers.HalfOpenUnitInterval()
    restored = keras.constraints.deserialize(keras.constraints.serialize(constraint))
    assert isinstance(restored, layers.HalfOpenUnitInterval)


def test_routed_block_round_trip_keeps_outputs():
    block = layers.ViTBlock(D, HEADS, MLP, routed=True)
    block.build((None, None, D))
    randomize_weights(block, seed=8)
    clone = config_roundtrip(block)
    clone.build((None, None, D))
    clone.set_weights(block.get_weights())
    groups, _ = mixed_groups()
    gates = [np.full((2, k), 0.3, "float32") for k in SIZES]
    for a, b in zip(block(groups, widths=WIDTHS, gates=gates), clone(groups, widths=WIDTHS, gates=gates)):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


class _FunctionOfVariable(keras.layers.Layer):
    """``function(variable)``, the variable initialised to ``value`` (inputs unused): gradients
    of a bare function through ``conftest.gradients``."""

    def __init__(self, value, function, **kwargs):
        super().__init__(**kwargs)
        self.function = function
        self.value = self.add_weight(shape=value.shape, initializer=keras.initializers.Constant(value))

    def call(self, inputs, training=None):
        return self.function(self.value, training)


def _gradient_of(function, value, loss):
    model = keras.Sequential([keras.Input((1,)), _FunctionOfVariable(value, function)])
    (grad,) = gradients(model, loss, np.zeros((1, 1), "float32"), model.trainable_variables)
    return grad


def _attention_gradient_reference(qkv, upstream):
    """float64 d sum(attention(qkv) * upstream) / d qkv, the softmax backward written out:
    dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dP P)), dQ = s dS K, dK = s dS^T Q."""
    q, k, v = (np.moveaxis(qkv[:, :, i].astype("float64"), 2, 1) for i in range(3))  # (B, H, N, d)
    scale = qkv.shape[-1] ** -0.5
    scores = scale * q @ np.swapaxes(k, -1, -2)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    d_out = np.moveaxis(upstream.astype("float64"), 2, 1)
    d_v = np.swapaxes(p, -1, -2) @ d_out
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - np.sum(d_p * p, -1, keepdims=True))
    d_q, d_k = scale * d_s @ k, scale * np.swapaxes(d_s, -1, -2) @ q
    return np.stack([np.moveaxis(g, 1, 2) for g in (d_q, d_k, d_v)], axis=2)


@pytest.mark.parametrize("received", [False, True], ids=["attended", "with_received"])
def test_attention_over_token_parts_equals_attention_over_their_concatenation(received):
    """``multi_head_attention`` on a list of token parts (MoNE's groups, put heads first one by
    one and then concatenated) gives the outputs, received attention and gradients of the same
    call on the concatenated tensor, and the gradient equals the float64 softmax backward."""
    qkv = 3 * rand(2, 7, 3, 2, 4, seed=5)
    upstream = rand(2, 7, 2, 4, seed=6)
    bounds = [(0, 3), (3, 5), (5, 7)]

    def on_parts(v):
        return multi_head_attention([v[:, a:b] for a, b in bounds], received)

    def on_whole(v):
        return multi_head_attention(v, received)

    outputs = {}
    for name, call in (("parts", on_parts), ("whole", on_whole)):
        result = call(keras.ops.convert_to_tensor(qkv))
        outputs[name] = [to_numpy(r) for r in (result if received else [result])]
    for part, whole in zip(outputs["parts"], outputs["whole"]):
        np.testing.assert_allclose(part, whole, rtol=0, atol=ATOL)

    def loss(out):
        return keras.ops.sum((out[0] if received else out) * keras.ops.convert_to_tensor(upstream))

    grad_parts = _gradient_of(lambda v, training: on_parts(v), qkv, loss)
    grad_whole = _gradient_of(lambda v, training: on_whole(v), qkv, loss)
    np.testing.assert_allclose(grad_parts, grad_whole, rtol=0, atol=ATOL)
    assert_f32_close(grad_parts, _attention_gradient_reference(qkv, upstream))


def test_attention_gradient_matches_the_softmax_backward():
    """The jax path stops the gradient of its max shift (exactly zero in exact arithmetic):
    gradients equal the softmax backward on every backend's path. Large scores make the
    shift matter: a wrong shift gradient would be O(1) off."""
    qkv = 3 * rand(2, 6, 3, 2, 4, seed=3)
    upstream = rand(2, 6, 2, 4, seed=4)
    grad = _gradient_of(lambda v, training: multi_head_attention(v), qkv,
                        lambda out: keras.ops.sum(out * keras.ops.convert_to_tensor(upstream)))
    assert_f32_close(grad, _attention_gradient_reference(qkv, upstream))


def test_gelu_is_x_phi_x_and_its_derivative_on_every_backend():
    """``layers.activations.gelu`` (erf form in training and after nested projections on jax,
    ``ops.gelu`` otherwise) against float64 x Phi(x) and Phi(x) + x phi(x), over the range
    activations take, tails included."""
    x = np.linspace(-12, 12, 2401, dtype="float32").reshape(1, -1)
    x64 = x.astype("float64")
    phi = np.exp(-0.5 * x64**2) / np.sqrt(2 * np.pi)
    cdf = 0.5 * (1 + np.vectorize(math.erf)(x64 / np.sqrt(2)))
    for training, nested in ((False, False), (True, False), (False, True)):
        value = gelu(keras.ops.convert_to_tensor(x), training=training, nested=nested)
        assert_f32_close(to_numpy(value), x64 * cdf)
    # the spelled-out erf of exported nested MLPs: within 4e-7 of erf (float32 erf: 3e-7)
    erf = to_numpy(rational_erf(keras.ops.convert_to_tensor(x / np.sqrt(2).astype("float32"))))
    np.testing.assert_allclose(erf, 2 * cdf - 1, rtol=0, atol=4e-7)
    grad = _gradient_of(lambda v, training: gelu(v, training=training), x, keras.ops.sum)
    assert_f32_close(grad, cdf + x64 * phi)


class _NestedDenseOfVariable(keras.layers.Layer):
    """``NestedDense(x)`` at given widths, ``x`` a variable (so its gradient is a variable's)."""

    def __init__(self, x, units, widths, **kwargs):
        super().__init__(**kwargs)
        self.x = self.add_weight(shape=x.shape, initializer=keras.initializers.Constant(x))
        self.dense = layers.NestedDense(units)
        self.dense.build(x.shape)
        self.widths = widths

    def call(self, inputs, training=None):
        widths = dict(self.widths)
        if widths.pop("tied", False):  # the slice cut after another tensor (NestedMLP's pre-activation)
            widths["slice_after"] = keras.ops.exp(self.x)
        return self.dense(self.x, **widths)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize(
    "widths", [dict(in_width=4), dict(out_width=8), dict(in_width=4, out_width=8), dict(out_width=8, tied=True),
               dict(rows=(1, 4)), dict(rows=(1, 4), out_width=8), dict(rows=(0, 2), in_width=4, out_width=8)],
    ids=["in", "out", "both", "tied", "rows", "rows-out", "rows-both"],
)
def test_nested_dense_gradients_are_those_of_the_sliced_product(widths, graph):
    """Input, kernel and bias gradients of a nested projection (jax and, for column slices,
    tensorflow: the hand-written backward pass that cuts the slice again) against numpy:
    dx = Pad(dy W[:a, :b]^T), dW = Pad(x[:, :a]^T dy). ``tied``: the slice is cut after another
    tensor (``slice_after``), which adds no gradient. ``rows``: the product of the rows
    ``x[:, start:stop]`` (jax cuts them again in the backward pass), whose gradient is padded
    with zeros along the tokens. ``graph``: tensorflow inside a ``tf.function``, where the tie
    is a control dependency (other backends: one run)."""
    if graph and BACKEND != "tensorflow":
        pytest.skip("eager and graph differ only on tensorflow")
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 5, 16)).astype("float32")
    start, stop = widths.get("rows", (0, 5))
    upstream = rng.normal(size=(2, stop - start, 32)).astype("float32")
    a, b = widths.get("in_width", 16), widths.get("out_width", 32)
    upstream[..., b:] = 0.0  # the padded outputs' gradient never reaches the product
    layer = _NestedDenseOfVariable(x, 32, widths)
    model = keras.Sequential([keras.Input((1,)), layer])
    randomize_weights(layer.dense, seed=4)
    kernel = to_numpy(layer.dense.kernel).astype("float64")
    grad_x, grad_kernel, grad_bias = gradients(
        model, lambda out: keras.ops.sum(out * keras.ops.convert_to_tensor(upstream)), np.zeros((1, 1), "float32"),
        [layer.x, layer.dense.kernel, layer.dense.bias], graph=graph,
    )
    dy = upstream[..., :b].astype("float64")
    expected_x = np.zeros_like(x, dtype="float64")
    expected_x[:, start:stop, :a] = dy @ kernel[:a, :b].T
    expected_kernel = np.zeros_like(kernel)
    expected_kernel[:a, :b] = x[:, start:stop, :a].reshape(-1, a).astype("float64").T @ dy.reshape(-1, b)
    assert_f32_close(grad_x, expected_x)
    assert_f32_close(grad_kernel, expected_kernel)
    assert_f32_close(grad_bias, upstream.reshape(-1, 32).sum(0))


class TestNestedDenseRows:
    """``NestedDense(x, rows=(start, stop))``: the projection of a token group's rows of a
    joined tensor (MoNE attention's out-projection), equal to cutting the rows first."""

    @pytest.mark.parametrize("widths", [{}, dict(out_width=8), dict(in_width=4, out_width=8)])
    def test_equals_the_cut_rows(self, widths):
        layer = built(layers.NestedDense(48), (None, None, D))
        x = rand(2, 7, D)
        out = to_numpy(layer(x, rows=(2, 5), **widths))
        assert out.shape == (2, 3, 48)
        np.testing.assert_allclose(out, to_numpy(layer(x[:, 2:5], **widths)), rtol=0, atol=ATOL)

    @pytest.mark.parametrize("rows", [(3, 3), (-1, 2), (2, 8), (1,), "ab", (1.5, 3)])
    def test_bad_rows_name_the_argument(self, rows):
        layer = built(layers.NestedDense(48), (None, None, D))
        with pytest.raises(ValueError, match="`rows`"):
            layer(rand(2, 7, D), rows=rows)

    def test_symbolic_shape(self):
        layer = layers.NestedDense(48)
        spec = layer.compute_output_spec(keras.KerasTensor((2, 7, D)), out_width=8, pad_output=False, rows=(2, 5))
        assert spec.shape == (2, 3, 8)

    @pytest.mark.skipif(BACKEND != "jax", reason="the backward pass's residuals are jax's")
    def test_backward_keeps_the_joined_tensor_not_the_cut(self):
        """What ``jax.vjp`` keeps for the backward pass: the joined input and the kernel,
        never a ``(batch, stop - start, ...)`` copy of the rows (MoNE's training step kept
        one such copy of attention's output per block and group, issue 40)."""
        import jax

        layer = built(layers.NestedDense(48), (None, None, D))
        kernel = layer.kernel.value
        x = jax.numpy.asarray(rand(2, 7, D))

        def project(x, kernel):
            return layer.stateless_call([kernel, layer.bias.value], [], x, out_width=8, rows=(2, 5))[0]

        _, pullback = jax.vjp(project, x, kernel)
        kept = [leaf.shape for leaf in jax.tree_util.tree_leaves(pullback) if hasattr(leaf, "shape")]
        assert (2, 7, D) in kept
        assert not [shape for shape in kept if len(shape) == 3 and shape[1] == 3], kept
        # ...and in the compiled step the backward pass's cut sits behind a barrier, which keeps
        # XLA's CSE from merging it with the forward pass's cut (and keeping that one instead)
        def loss(x, kernel):
            return jax.numpy.sum(project(x, kernel) ** 2)

        step = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, kernel).as_text()
        assert "optimization_barrier" in step
        assert "optimization_barrier" not in jax.jit(loss).lower(x, kernel).as_text()

    def test_rows_of_a_wider_input_keep_the_input_itself(self):
        # in_width < the input's features: both cuts are made inside the product, and the
        # backward pass keeps the input, not a (batch, tokens, in_width) copy of it
        if BACKEND != "jax":
            pytest.skip("the backward pass's residuals are jax's")
        import jax

        layer = built(layers.NestedDense(48), (None, None, D))
        x = jax.numpy.asarray(rand(2, 7, D))

        def project(x):
            return layer.stateless_call([layer.kernel.value, layer.bias.value], [], x, in_width=8, rows=(2, 5))[0]

        _, pullback = jax.vjp(project, x)
        kept = [leaf.shape for leaf in jax.tree_util.tree_leaves(pullback) if hasattr(leaf, "shape")]
        assert (2, 7, D) in kept and (2, 7, 8) not in kept and (2, 3, 8) not in kept, kept
        np.testing.assert_allclose(np.asarray(project(x)), to_numpy(layer(rand(2, 7, D)[:, 2:5], in_width=8)),
                                   rtol=0, atol=ATOL)
