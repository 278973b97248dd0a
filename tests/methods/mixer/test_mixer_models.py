"""MLP-Mixer and Sparse-MLP backbones on the backbone contract (issue 26)."""

import keras
import numpy as np
import pytest
from conftest import BATCH, images, randomize_weights, to_numpy

from keras_mone import flops, models, presets
from keras_mone.methods.registry import architectures

TINY = architectures()["mixer"].tiny_config
SPARSE_TINY = architectures()["sparse_mlp"].tiny_config


def _layer_norm(x, gamma, beta, eps=1e-6):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def _gelu(x):
    from scipy.special import erf

    return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def _mlp(x, mlp):
    w = [to_numpy(v).astype("float64") for v in mlp.weights]  # fc1 kernel, bias, fc2 kernel, bias
    return _gelu(x @ w[0] + w[1]) @ w[2] + w[3]


def numpy_mixer(backbone, x):
    """Mixer forward in float64 from the paper's equations: patches, blocks, LayerNorm."""
    p = backbone.patch_size
    kernel, bias = (to_numpy(v).astype("float64") for v in backbone.patch_embedding.projection.weights)
    b, h, w, c = x.shape
    patches = x.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, p * p * c)
    tokens = patches @ kernel.reshape(p * p * c, -1) + bias
    for block in backbone.blocks:
        g0, b0 = (to_numpy(v).astype("float64") for v in block.layer_norm_0.weights)
        g1, b1 = (to_numpy(v).astype("float64") for v in block.layer_norm_1.weights)
        mixed = _mlp(_layer_norm(tokens, g0, b0).transpose(0, 2, 1), block.token_mixing).transpose(0, 2, 1)
        tokens = tokens + mixed
        tokens = tokens + _mlp(_layer_norm(tokens, g1, b1), block.channel_mixing)
    g, bb = (to_numpy(v).astype("float64") for v in backbone.norm.weights)
    return _layer_norm(tokens, g, bb)


def test_mixer_backbone_matches_a_numpy_mixer():
    # Rules out: position embeddings added, token mixing over channels instead of
    # tokens (a missing transpose), a post-norm block, a missing final LayerNorm.
    backbone = models.MixerBackbone(**TINY)
    backbone.build()
    randomize_weights(backbone, seed=2)
    x = images(size=TINY["image_size"])
    np.testing.assert_allclose(to_numpy(backbone(x)), numpy_mixer(backbone, x.astype("float64")), atol=2e-5)
    assert backbone.patch_embedding.position_embedding is None


def test_mixer_has_no_capacity_and_refuses_another():
    backbone = models.MixerBackbone(**TINY)
    assert backbone.capacity == 1.0 and backbone.realised_capacity == 1.0 and not backbone.routed
    with pytest.raises(ValueError, match="no routing"):
        backbone.set_capacity(0.5)


def test_arguments_a_backbone_does_not_take_are_errors():
    # Rules out: build_backbone (presets, recipes) dropping arguments silently.
    with pytest.raises(ValueError, match=r"num_heads"):
        architectures()["mixer"].build_backbone(**TINY, num_heads=4)
    with pytest.raises(ValueError, match=r"token_mlp_dim"):
        architectures()["vit"].build_backbone(image_size=32, patch_size=8, token_mlp_dim=8)
    with pytest.raises(ValueError, match="Mixer"):
        architectures()["mixer"].decode_variant("Ti/16")  # no Ti in the Mixer size table


def test_sparse_mlp_trains_with_its_load_balancing_loss_logged():
    # Rules out: the auxiliary loss not reaching the training loss or not logged;
    # the record computed outside training. Without gate noise the training
    # forward equals the inference one, so loss = task loss + the logged term.
    backbone = models.SparseMLPBackbone(**SPARSE_TINY, noise=False)
    model = models.SparseMLPClassifier(backbone, num_classes=3)
    model.build()
    randomize_weights(model, seed=4)
    x = images(size=SPARSE_TINY["image_size"])
    y = keras.ops.one_hot(np.arange(BATCH) % 3, 3)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0).history
    assert history["moe_aux_loss"][0] > 0
    task = model.evaluate(x, y, verbose=0, return_dict=True)["loss"]
    assert history["loss"][0] == pytest.approx(task + history["moe_aux_loss"][0], rel=1e-4, abs=1e-6)
    np.testing.assert_array_equal(to_numpy(model(x)), to_numpy(model(x)))  # inference is deterministic
    _, record = backbone(x, return_intermediates=True)
    assert len(record["moe"]) == backbone.sparse_depth


def test_sparse_mlp_preset_parameter_counts_within_5_percent_of_the_paper():
    # Table 2 gives 22M for Sparse-S (a recount from the table: 22.9M, head included).
    model = presets.from_preset("sparse_mlp_s", load_weights=False)
    assert abs(model.count_params() / 1e6 - 22.0) / 22.0 < 0.05


@pytest.mark.large
@pytest.mark.parametrize("name, paper", [("sparse_mlp_b", 69.0), ("sparse_mlp_l", 130.0), ("mixer_b16", 59.0)])
def test_large_parameter_counts(name, paper):
    model = presets.from_preset(name, load_weights=False)
    assert abs(model.count_params() / 1e6 - paper) / paper < 0.05


def test_mixer_flops_match_the_published_figures():
    # Mixer paper: B/16 12.61, L/16 44.57 GFLOPs (MACs) at 224 with 1000 classes.
    b16 = presets.from_preset("mixer_b16", load_weights=False)
    assert flops(b16).gmacs == pytest.approx(12.61, rel=0.005)
    tiny = models.SparseMLPBackbone(**SPARSE_TINY)
    count = flops(tiny).breakdown
    # MoE_S: 4 experts, capacity ceil(1.25 * 1 * 8 / 4) = 3 columns each, 24 -> 16 -> 24.
    assert count["token_moe"] == 4 * 3 * 2 * 24 * 16
    # MoE_C: 2 experts, capacity ceil(1.25 * 2 * 24 / 2) = 30 -> 24 tokens (at most all), 8 -> 16 -> 8.
    assert count["channel_moe"] == 2 * 24 * 2 * 8 * 16


def test_mixer_recipe_builds_with_its_own_size_table(tmp_path):
    from keras_mone import recipes
    from keras_mone.recipes.schema import RecipeError

    setup = recipes.load(
        "cluttered_digits_mixer", epochs=1, steps_per_epoch=1, samples_per_digit=1, test_samples_per_digit=1,
        batch_size=8, output_dir=str(tmp_path / "a"),
    )
    assert isinstance(setup.model.backbone, models.MixerBackbone) and setup.model.backbone.hidden_dim == 64
    with pytest.raises(RecipeError, match="dropout_rate"):  # a ViT-only recipe key is not dropped
        recipes.load("cluttered_digits_mixer", dropout_rate=0.1, output_dir=str(tmp_path / "b"))


def test_sparse_mlp_starts_from_mixer_weights():
    # Issue 26 item 4: the dense blocks, patch embedding and final norm come from
    # the Mixer; only RR layers and sparse blocks stay new. Rules out copying the
    # Mixer's *last* blocks or leaving the dense part random.
    from keras_mone.methods.mixer.transfer import sparse_mlp_from_mixer

    mixer = models.MixerBackbone(**{**TINY, "depth": 3})
    mixer.build()
    randomize_weights(mixer, seed=5)
    sparse = models.SparseMLPBackbone(**{**SPARSE_TINY, "depth": 2})
    sparse.build()
    left = sparse_mlp_from_mixer(mixer, sparse)
    assert left and all(p.split("/")[0] in ("re_represent_1", "re_represent_2") or p.startswith("sparse_block_")
                        for p in left)
    x = images(size=TINY["image_size"])
    expected, got = mixer.patch_embedding(x), sparse.patch_embedding(x)
    for i in range(2):
        expected, got = mixer.blocks[i](expected), sparse.blocks[i](got)
    np.testing.assert_array_equal(to_numpy(got), to_numpy(expected))
    with pytest.raises(ValueError, match="needs 4"):
        sparse_mlp_from_mixer(mixer, models.SparseMLPBackbone(**{**SPARSE_TINY, "depth": 4}))
