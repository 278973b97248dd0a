"""Mixture-of-Depths and A-MoD (issue 16): token skipping, image and video.

References: the dense ViT on the same weights; a numpy A-MoD score from the
previous block's attention map (``numpy_reference``); numpy gathers for what
a routed block does to selected and skipped tokens.
"""

import warnings

import keras
import numpy as np
import pytest

import numpy_reference as ref
from conftest import TINY, TINY_VIDEO, gradients, images, randomize_weights, relative_weights, to_numpy, videos
from keras_mone import flops, models, routing

# TINY: 16 tokens (+1 class token), depth 2 -> block 1 routes by default.
CONFIG = dict(TINY, use_class_token=True)


def pair(cls, **kwargs):
    """``(skipping backbone, dense ViT)`` sharing random weights (MoD's router drawn too)."""
    dense = models.ViTBackbone(**CONFIG)
    dense.build()
    randomize_weights(dense, seed=3, scale=0.2)
    backbone = cls(**CONFIG, **kwargs)
    backbone.build()
    models.transfer_weights(dense, backbone)
    for router in backbone.routers:
        randomize_weights(router, seed=4, scale=0.5)
    return backbone, dense


def built(cls, **kwargs):
    return pair(cls, **kwargs)[0]


@pytest.mark.parametrize("cls", [models.MoDViTBackbone, models.AMoDViTBackbone])
def test_full_capacity_equals_the_dense_vit(cls):
    backbone, dense = pair(cls, capacity=1.0)
    np.testing.assert_array_equal(to_numpy(backbone(images())), to_numpy(dense(images())))


def test_amod_scores_are_the_attention_received_in_the_previous_block():
    backbone = built(models.AMoDViTBackbone, capacity=0.5)
    x = images()
    _, extra = backbone(x, return_intermediates=True)
    weights = relative_weights(backbone)
    tokens = ref.patch_embedding(
        x, weights["patch_embedding/projection/kernel"], weights["patch_embedding/projection/bias"],
        weights["patch_embedding/class_token"], weights["patch_embedding/position_embedding"], TINY["patch_size"],
    )
    params = ref.block_params(weights, 0, TINY["num_heads"])
    normed = ref.layer_norm(tokens, params["norm1_gamma"], params["norm1_beta"])
    qkv = normed @ params["qkv_kernel"] + params["qkv_bias"]
    batch, n, d = normed.shape
    h = TINY["num_heads"]
    q, k = (qkv[..., i * d:(i + 1) * d].reshape(batch, n, h, d // h).transpose(0, 2, 1, 3) for i in range(2))
    probs = ref.softmax(q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // h), axis=-1)
    expected = probs.mean(axis=(1, 2))  # over heads and query rows
    np.testing.assert_allclose(to_numpy(extra["scores"][0]), expected, atol=1e-5)


@pytest.mark.parametrize("cls", [models.MoDViTBackbone, models.AMoDViTBackbone])
def test_routed_block_runs_on_the_selected_tokens_and_skips_the_rest(cls):
    backbone = built(cls, capacity=0.25)
    k = backbone.selected_tokens()
    assert k == 4  # floor(0.25 * 17)
    x = images()
    tokens_in = to_numpy(backbone.blocks[0](backbone.patch_embedding(x)))  # input of routed block 1
    _, extra = backbone(x, return_intermediates=True)
    scores, selected = to_numpy(extra["scores"][0]), to_numpy(extra["selected"][0])
    assert selected.shape == (2, k)
    for b in range(2):  # exactly k distinct tokens, the k highest scores (ties to the lower index)
        assert len(set(selected[b])) == k
        np.testing.assert_array_equal(selected[b], np.argsort(-scores[b], kind="stable")[:k])
    # after block 1 the encoder ends: undo the final LayerNorm's input by running the routed step by hand
    block_out = to_numpy(backbone.blocks[1](keras.ops.convert_to_tensor(np.take_along_axis(tokens_in, selected[..., None], 1))))
    chosen = np.take_along_axis(tokens_in, selected[..., None], 1)
    update = block_out - chosen
    if cls is models.MoDViTBackbone:
        update = update * np.take_along_axis(scores, selected, 1)[..., None]
    expected = tokens_in.copy()
    for b in range(2):
        expected[b, selected[b]] = chosen[b] + update[b]
    norm = backbone.norm
    np.testing.assert_allclose(to_numpy(backbone(x)), to_numpy(norm(expected)), atol=2e-5)
    skipped = np.ones((2, 17), bool)
    for b in range(2):
        skipped[b, selected[b]] = False
    np.testing.assert_array_equal(expected[skipped], tokens_in[skipped])  # skipped tokens unchanged


def test_gradients_reach_the_mod_router():
    # GAP: the loss sees every token, the selected ones included
    model = models.ImageClassifier(built(models.MoDViTBackbone, capacity=0.25), num_classes=3, pooling="gap")
    model.build()
    randomize_weights(model.head, seed=6)
    y = np.eye(3, dtype="float32")[[0, 2]]
    loss = keras.losses.CategoricalCrossentropy(from_logits=True)
    router = model.backbone.routers[0].kernel
    grads = gradients(model, lambda out: loss(y, out), images(), [router])
    assert np.abs(to_numpy(grads[0])).max() > 0


@pytest.mark.parametrize("cls", [models.MoDViTBackbone, models.AMoDViTBackbone])
def test_keras_round_trip_and_capacity(cls, tmp_path):
    model = models.ImageClassifier(built(cls, capacity=0.5), num_classes=3, pooling="token")
    path = str(tmp_path / "mod.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(loaded.predict(images(), verbose=0), model.predict(images(), verbose=0), atol=1e-6)
    assert loaded.backbone.capacity == 0.5 and loaded.backbone.routed_blocks == [1]
    model.set_capacity(0.25)
    assert model.predict(images(), verbose=0).shape == (2, 3)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="capacity"):
        models.MoDViTBackbone(**CONFIG, capacity=0.0)
    with pytest.raises(ValueError, match="capacity"):
        models.MoDViTBackbone(**CONFIG, capacity=1.5)
    with pytest.raises(ValueError, match="routed_blocks"):
        models.MoDViTBackbone(**CONFIG, routed_blocks=[5])
    with pytest.raises(ValueError, match="routed_blocks"):
        models.AMoDViTBackbone(**CONFIG, routed_blocks=[0])  # needs a previous block's attention
    with pytest.raises(ValueError, match="score"):
        models.MoDViTBackbone(**CONFIG, score="random")


def test_flops_follow_the_block_plan():
    mod, dense = pair(models.MoDViTBackbone, capacity=0.25)
    assert mod.block_plan() == [17, 4]
    block = lambda n: n * 3 * 32 * 32 + 2 * n * n * 32 + n * 32 * 32 + 2 * n * 32 * 64  # noqa: E731
    assert flops(dense).total - flops(mod).total == block(17) - block(4) - 17 * 32  # minus the router
    selected, skipped = routing.select_top_k(np.array([[0.5, np.nan, 2.0, 0.5]], "float32"), 2)
    assert to_numpy(selected).tolist() == [[2, 0]] and to_numpy(skipped).tolist() == [[1, 3]]


@pytest.mark.parametrize("cls", [models.MoDViViTBackbone, models.AMoDViViTBackbone])
def test_video_forms_route_per_frame(cls):
    backbone = cls(**TINY_VIDEO, capacity=0.5)
    backbone.build()
    out = to_numpy(backbone(videos()))
    assert out.shape == (2, backbone.num_output_tokens, TINY_VIDEO["hidden_dim"]) and np.isfinite(out).all()
    backbone.set_capacity(1.0)
    dense = models.ViViTBackbone(**TINY_VIDEO)
    dense.build()
    randomize_weights(dense, seed=5, scale=0.2)
    models.transfer_weights(dense, backbone)
    np.testing.assert_array_equal(to_numpy(backbone(videos())), to_numpy(dense(videos())))


def test_mod_recipes_train_and_convert_from_the_dense_preset(tmp_path):
    from keras_mone import recipes
    from recipe_helpers import tiny_overrides

    for name in ("cluttered_digits_amod_from_dense", "cluttered_digits_mod"):
        overrides = tiny_overrides(tmp_path / name, test_samples_per_digit=1)
        if name.endswith("from_dense"):  # vit_digits' size, so that its weights fit
            overrides["model_args"] = {}
        setup = recipes.load(name, **overrides)
        assert isinstance(setup.model.backbone, models.MoDViTBackbone)
        results = setup.fit(verbose=0)
        assert np.isfinite(results["loss"]) and results["gmacs"] < flops(dense_of(setup.model)).gmacs


def dense_of(model):
    config = {k: v for k, v in model.backbone.get_config().items() if k in ("image_size", "patch_size", "hidden_dim", "depth", "num_heads", "mlp_dim")}
    dense = models.ViTBackbone(**config)
    return dense


@pytest.mark.parametrize("cls", [models.MoDViTBackbone, models.AMoDViTBackbone])
def test_capacity_rounded_to_whole_tokens_warns(cls):
    # Issue 24 item 6: 0.01 of 16 tokens runs 1 token (capacity 0.0625) and must say so;
    # a capacity that whole tokens meet exactly must not warn. Rules out a silent clamp.
    with pytest.warns(UserWarning, match=r"realised as 0\.062.*at least one token"):
        backbone = cls(**TINY, capacity=0.01)
    assert backbone.realised_capacity == 1 / 16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backbone.set_capacity(0.5)
