"""Nested layers against the numpy reference of App. A.1 Eq. 6-7 and Eq. 1: NestedDense, NestedMLP,
ViTBlock, the patch embedding, DropPath, the routers and the GELU (attention: test_mone_attention.py;
row-cut projections and their gradients: test_nested_dense_rows.py; configs: test_layer_configs.py)."""

import math

import keras
import numpy as np
import numpy_reference as ref
import pytest
from conftest import assert_f32_close, f32_tolerance, max_abs_diff, randomize_weights, to_numpy
from nested_layer_cases import (
    ATOL,
    D,
    HEADS,
    MLP,
    SIZES,
    WIDTHS,
    block_params,
    built,
    gradient_of,
    mixed_groups,
    rand,
    weights_of,
)

from keras_mone import layers
from keras_mone.layers.activations import gelu, rational_erf


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
    grad = gradient_of(lambda v, training: gelu(v, training=training), x, keras.ops.sum)
    assert_f32_close(grad, cdf + x64 * phi)
