"""MoNEAttention against the numpy reference of App. A.1 Eq. 5, and multi-head attention over
token groups against attention over their concatenation and the float64 softmax backward."""

import keras
import numpy as np
import numpy_reference as ref
import pytest
from conftest import assert_f32_close, max_abs_diff, to_numpy
from nested_layer_cases import ATOL, D, HEADS, WIDTHS, attention_params, built, gradient_of, mixed_groups, rand

from keras_mone import layers
from keras_mone.layers.attention import multi_head_attention


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

    grad_parts = gradient_of(lambda v, training: on_parts(v), qkv, loss)
    grad_whole = gradient_of(lambda v, training: on_whole(v), qkv, loss)
    np.testing.assert_allclose(grad_parts, grad_whole, rtol=0, atol=ATOL)
    assert_f32_close(grad_parts, _attention_gradient_reference(qkv, upstream))


def test_attention_gradient_matches_the_softmax_backward():
    """The jax path stops the gradient of its max shift (exactly zero in exact arithmetic):
    gradients equal the softmax backward on every backend's path. Large scores make the
    shift matter: a wrong shift gradient would be O(1) off."""
    qkv = 3 * rand(2, 6, 3, 2, 4, seed=3)
    upstream = rand(2, 6, 2, 4, seed=4)
    grad = gradient_of(lambda v, training: multi_head_attention(v), qkv,
                        lambda out: keras.ops.sum(out * keras.ops.convert_to_tensor(upstream)))
    assert_f32_close(grad, _attention_gradient_reference(qkv, upstream))
