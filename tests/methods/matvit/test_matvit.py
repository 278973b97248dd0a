"""MatViT (MoNE's MatFormer baseline): nested widths, joint training, FLOPs, saving."""

import keras
import numpy as np
import pytest

from conftest import NUM_TOKENS, TINY, assert_f32_close, images, randomize_weights, to_numpy
from keras_mone.analysis import flops
from keras_mone.models import ViTBackbone
from keras_mone.methods.matvit.backbone import MatViTBackbone
from keras_mone.methods.matvit.classifier import MatViTClassifier
from keras_mone.training import SumOverWidths


def _pair():
    matvit, dense = MatViTBackbone(**TINY), ViTBackbone(**TINY)
    matvit.build()
    dense.build()
    randomize_weights(matvit, seed=3)
    for target, source in zip(dense.weights, matvit.weights):
        target.assign(source)
    return matvit, dense


def test_full_width_equals_dense_vit():
    matvit, dense = _pair()
    x = images()
    assert_f32_close(to_numpy(matvit(x)), to_numpy(dense(x)))
    matvit.set_width(0.25)
    assert np.max(np.abs(to_numpy(matvit(x)) - to_numpy(dense(x)))) > 1e-3


def test_width_is_a_prefix_of_the_features():
    # At width d every block reads only the first d features of each token and
    # writes only to the first d: changing the embedding's later features must
    # leave the first d features of every block update unchanged.
    matvit, _ = _pair()
    tokens = np.random.default_rng(0).standard_normal((2, NUM_TOKENS, TINY["hidden_dim"])).astype("float32")
    d = TINY["hidden_dim"] // 8
    block = matvit.blocks[0]
    out = to_numpy(block([tokens], widths=[d])[0])
    assert np.allclose(out[..., d:], tokens[..., d:])  # untouched beyond d (padded updates)
    assert not np.allclose(out[..., :d], tokens[..., :d])


def test_width_one_eighth_costs_what_it_should():
    matvit = MatViTBackbone(width_fraction=0.125, **TINY)
    n, D, M, depth = NUM_TOKENS, TINY["hidden_dim"], TINY["mlp_dim"], TINY["depth"]
    d = D // 8
    count = flops(matvit).breakdown
    assert count["qkv"] == depth * n * d * 3 * D
    assert count["attention"] == depth * 2 * n * n * D
    assert count["attention_output"] == depth * n * D * d
    assert count["mlp"] == depth * 2 * n * d * M
    dense = flops(ViTBackbone(**TINY)).breakdown
    for name in ("qkv", "attention_output", "mlp"):
        assert count[name] * 8 == dense[name]
    mixed = MatViTBackbone(layer_width_fractions=[1.0, 0.125], **TINY)
    assert flops(mixed).breakdown["mlp"] == (dense["mlp"] + dense["mlp"] // 8) // 2


def test_set_width_validation():
    matvit = MatViTBackbone(**TINY)
    assert matvit.nested_fractions == (0.125, 0.25, 0.5, 1.0)
    with pytest.raises(ValueError, match="width_fraction"):
        matvit.set_width(0.3)
    with pytest.raises(ValueError, match="one fraction per block"):
        matvit.set_width(1.0, [0.5])


def test_joint_training_output_and_loss_sum_over_widths():
    backbone = MatViTBackbone(**TINY)
    model = MatViTClassifier(backbone, num_classes=5, head_bias_init=0.1)
    model.build()
    randomize_weights(model, seed=1)
    x = images()
    labels = keras.ops.one_hot(np.array([1, 3]), 5)
    stacked = model(x, training=True)
    assert tuple(stacked.shape) == (2, 4, 5)
    loss = SumOverWidths(keras.losses.CategoricalCrossentropy(from_logits=True))
    expected = 0.0
    ce = keras.losses.CategoricalCrossentropy(from_logits=True)
    for w, fraction in enumerate(backbone.nested_fractions):
        backbone.set_width(fraction)
        logits = model(x, training=False)
        assert_f32_close(to_numpy(stacked[:, w]), to_numpy(logits))
        expected += float(to_numpy(ce(labels, logits)))
    np.testing.assert_allclose(float(to_numpy(loss(labels, stacked))), expected, rtol=1e-5)


def test_keras_roundtrip_keeps_widths(tmp_path):
    backbone = MatViTBackbone(layer_width_fractions=[0.25, 1.0], **TINY)
    model = MatViTClassifier(backbone, num_classes=4)
    model.build()
    randomize_weights(model, seed=2)
    x = images()
    expected = to_numpy(model(x))
    path = str(tmp_path / "matvit.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    assert type(restored) is MatViTClassifier
    assert restored.backbone.layer_width_fractions == [0.25, 1.0]
    np.testing.assert_array_equal(to_numpy(restored(x)), expected)


def test_mix_and_match_widths_apply_in_block_order():
    # Rules out: `layer_width_fractions` applied in reverse block order, which
    # keeps the total FLOPs of [1.0, 0.125] (issue 30, item 5). Checked per block:
    # the plan the FLOP count uses, the widths the forward pass records, the output.
    matvit, _ = _pair()
    matvit.set_width(layer_width_fractions=[1.0, 0.125])
    D, n = TINY["hidden_dim"], matvit.num_tokens
    assert matvit.layer_widths() == [D, D // 8]
    assert matvit.token_routing().block_plan(n) == [[(n, D)], [(n, D // 8)]]
    x = images()
    out, intermediates = matvit(x, return_intermediates=True)
    shares = [float(np.max(to_numpy(entry["compute"]))) for entry in intermediates["blocks"]]
    assert shares == [1.0, 0.125]
    expected = matvit.encode_at(matvit.patch_embedding(x), [D, D // 8])
    assert_f32_close(to_numpy(out), to_numpy(expected))
    reversed_widths = matvit.encode_at(matvit.patch_embedding(x), [D // 8, D])
    assert np.max(np.abs(to_numpy(out) - to_numpy(reversed_widths))) > 1e-3
