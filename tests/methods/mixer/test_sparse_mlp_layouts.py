"""Sparse-MLP's Re-represent layouts (Lou et al. 2021, Sec. 2.4 and Table 7; issue 26 item 4).

``per_block`` (the paper's text: RR layers at the beginning and the end of
each sparse block), ``shared`` (one pair around all sparse blocks) and
``none`` (Table 7's "w/o r_layers").
"""

import keras
import numpy as np
import pytest
from conftest import images, randomize_weights, to_numpy

from keras_mone import flops, models, presets
from keras_mone.methods.registry import architectures

TINY = {**architectures()["sparse_mlp"].tiny_config, "sparse_depth": 2}


def rr_parameters(tokens, channels, sparse_tokens, sparse_channels):
    """Parameters of one RR1 + RR2 pair: two LayerNorms and two biased projections each."""
    rr1 = 2 * 2 * channels + (tokens * sparse_tokens + sparse_tokens) + (channels * sparse_channels + sparse_channels)
    rr2 = 2 * 2 * sparse_channels + (sparse_tokens * tokens + tokens) + (sparse_channels * channels + channels)
    return rr1 + rr2


def build(**overrides):
    backbone = models.SparseMLPBackbone(**{**TINY, **overrides})
    backbone.build()
    return backbone


def test_per_block_has_one_pair_per_sparse_block_and_counts_them():
    per_block, shared = build(), build(re_represent="shared")
    assert len(per_block.re_represent_pairs()) == 2 and len(shared.re_represent_pairs()) == 1
    s, c = per_block.num_tokens, per_block.hidden_dim
    pair = sum(int(np.prod(w.shape)) for layer in per_block.re_represent_pairs()[1] for w in layer.weights)
    assert per_block.count_params() - shared.count_params() == pair
    macs = flops(per_block).breakdown["re_represent"]
    assert macs == 2 * flops(shared).breakdown["re_represent"]
    s2, c2 = per_block.sparse_tokens, per_block.sparse_hidden_dim
    assert macs == 2 * ((s * s2 * c + s2 * c * c2) + (s2 * s * c2 + s * c2 * c))


def test_per_block_runs_rr1_block_rr2_for_every_sparse_block():
    backbone = build()
    randomize_weights(backbone, seed=3)
    x = images(size=TINY["image_size"])
    tokens = backbone.patch_embedding(x)
    for block in backbone.blocks:
        tokens = block(tokens)
    for (rr1, rr2), block in zip(backbone.re_represent_pairs(), backbone.sparse_blocks):
        tokens = rr2(block(rr1(tokens), training=False))
    expected = backbone.norm(tokens)
    np.testing.assert_allclose(to_numpy(backbone(x)), to_numpy(expected), rtol=1e-5, atol=1e-5)


def test_shared_and_per_block_agree_with_one_sparse_block():
    one, other = build(sparse_depth=1), build(sparse_depth=1, re_represent="shared")
    randomize_weights(one, seed=1)
    other.set_weights(one.get_weights())
    x = images(size=TINY["image_size"])
    np.testing.assert_array_equal(to_numpy(one(x)), to_numpy(other(x)))
    assert [w.path for w in one.weights] == [w.path for w in other.weights]


def test_none_runs_the_sparse_blocks_on_the_mixer_shape():
    backbone = build(re_represent="none", sparse_tokens=None, sparse_hidden_dim=None)
    assert (backbone.sparse_tokens, backbone.sparse_hidden_dim) == (backbone.num_tokens, backbone.hidden_dim)
    assert backbone.re_represent_pairs() == [] and flops(backbone).breakdown["re_represent"] == 0
    _, record = backbone(images(size=TINY["image_size"]), return_intermediates=True)
    assert len(record["moe"]) == 2
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(backbone))
    assert restored.re_represent == "none" and restored.count_params() == backbone.count_params()


def test_default_sparse_shape_is_the_papers_2s_and_half_c():
    backbone = build(sparse_tokens=None, sparse_hidden_dim=None)
    assert backbone.sparse_tokens == 2 * backbone.num_tokens
    assert backbone.sparse_hidden_dim == backbone.hidden_dim // 2


@pytest.mark.parametrize("overrides, match", [
    (dict(re_represent="around"), "re_represent must be one of"),
    (dict(re_represent="none"), "sparse_tokens=24: without Re-represent"),
    (dict(re_represent="none", sparse_tokens=None, sparse_hidden_dim=4), "sparse_hidden_dim=4"),
    (dict(hidden_dim=15, sparse_hidden_dim=None), "hidden_dim=15 is odd"),
])
def test_bad_layouts_are_named(overrides, match):
    with pytest.raises(ValueError, match=match):
        models.SparseMLPBackbone(**{**TINY, **overrides})


def test_sparse_mlp_s_reproduces_the_table_2_recount():
    # Table 2 with RR layers in every sparse block: 22.9M (the table rounds to 22M);
    # one shared pair would give 22.2M.
    model = presets.from_preset("sparse_mlp_s", load_weights=False)
    backbone = model.backbone
    s, c = backbone.num_tokens, backbone.hidden_dim
    pairs = backbone.sparse_depth * rr_parameters(s, c, backbone.sparse_tokens, backbone.sparse_hidden_dim)
    rr_weights = sum(
        int(np.prod(w.shape)) for pair in backbone.re_represent_pairs() for layer in pair for w in layer.weights
    )
    assert rr_weights == pairs
    assert model.count_params() / 1e6 == pytest.approx(22.9, abs=0.05)
