"""ViViT factorised encoder and MoNE-ViViT (issue 4): layers, models, init, data, presets."""

import keras
import numpy as np
import pytest

import keras_mone
from conftest import (
    BATCH,
    TINY_SPATIAL as SPATIAL,
    TINY_VIDEO as VIDEO,
    assert_f32_close,
    max_abs_diff,
    per_example_counts,
    randomize_weights,
    relative_weights,
    run_serialization_roundtrip,
    to_numpy,
    videos,
)
from keras_mone import presets
from keras_mone.analysis import vit_block_macs
from keras_mone.data import load_moving_digits
from keras_mone.layers import TubeletEmbedding, inflate_patch_kernel
from keras_mone.models import (
    MoNEViTBackbone,
    MoNEViViTBackbone,
    VideoClassifier,
    ViTBackbone,
    ViViTBackbone,
    load_image_weights,
    transfer_weights,
    vivit_from_image_backbone,
)
from numpy_reference import vivit_forward


def built(model):
    model.build()
    return model


@pytest.mark.parametrize("use_class_token", [True, False])
def test_dense_vivit_matches_numpy_reference(use_class_token):
    model = built(ViViTBackbone(**VIDEO, use_class_token=use_class_token))
    randomize_weights(model, seed=1)
    x = videos()
    out = to_numpy(model(x))
    assert out.shape == (BATCH, 2 + int(use_class_token), 32)
    expected = vivit_forward(
        relative_weights(model), x, depth=2, temporal_depth=1, num_heads=4, use_class_token=use_class_token
    )
    assert_f32_close(out, expected)


def test_the_tanh_gelu_reaches_the_temporal_transformer_too(monkeypatch):
    """``gelu_approximate=True`` (flax's ``nn.gelu``, as the AugReg presets) is the GELU of
    every block: the spatial ones and the temporal transformer's (a numpy forward pass with
    the tanh form throughout), and survives the layers' configs."""
    import numpy_reference

    def tanh_gelu(x):
        x = np.asarray(x, np.float64)
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))

    model = built(ViViTBackbone(**VIDEO, gelu_approximate=True))
    randomize_weights(model, seed=3)
    x = videos()
    monkeypatch.setattr(numpy_reference, "gelu", tanh_gelu)
    expected = vivit_forward(relative_weights(model), x, depth=2, temporal_depth=1, num_heads=4)
    assert_f32_close(to_numpy(model(x)), expected)
    assert model.temporal_encoder.gelu_approximate
    assert all(block.mlp.gelu_approximate for block in model.temporal_encoder.blocks)
    assert ViViTBackbone.from_config(model.get_config()).temporal_encoder.gelu_approximate
    with pytest.raises(ValueError, match="`gelu_approximate` must be True or False"):
        keras_mone.layers.SequenceEncoder(2, 32, 1, 4, 64, gelu_approximate="tanh")


def test_mone_vivit_routes_every_frame_exactly_and_matches_reference():
    model = built(MoNEViViTBackbone(**VIDEO, capacity=0.5))
    randomize_weights(model, seed=2)
    x = videos(seed=3)
    out, intermediates = model(x, return_intermediates=True)
    expert_index = to_numpy(intermediates["expert_index"][0])
    # one row per frame index of every clip, each meeting the capacity exactly
    assert expert_index.shape == (BATCH * 2, 5)
    counts, dropped = model.expert_token_counts()
    assert sum(counts) + dropped == 5 and counts != (0, 0, 0, 5)
    per_frame = per_example_counts(expert_index, 4)
    np.testing.assert_array_equal(per_frame, np.tile([*counts, dropped], (BATCH * 2, 1)))
    expected = vivit_forward(
        relative_weights(model), x, depth=2, temporal_depth=1, num_heads=4,
        router_positions=(0,), expert_index=[expert_index],
    )
    assert_f32_close(to_numpy(out), expected)


def test_router_probabilities_are_per_frame():
    # Frame indices of a clip are routed independently: a clip whose second
    # frame index is a copy of the first gets the same assignment for both.
    model = built(MoNEViViTBackbone(**VIDEO, capacity=0.4))
    randomize_weights(model, seed=4)
    x = videos(batch=1, seed=5)
    x[:, 2:] = x[:, :2]
    _, intermediates = model(x, return_intermediates=True)
    expert_index = to_numpy(intermediates["expert_index"][0])
    np.testing.assert_array_equal(expert_index[0], expert_index[1])


@pytest.mark.parametrize("use_class_token", [True, False])
def test_full_capacity_equals_dense_vivit(use_class_token):
    dense = built(ViViTBackbone(**VIDEO, use_class_token=use_class_token))
    randomize_weights(dense, seed=6)
    mone = built(MoNEViViTBackbone(**VIDEO, use_class_token=use_class_token, capacity=1.0))
    new = transfer_weights(dense, mone)
    assert new == ["block_0/alpha", "block_1/alpha", "router_0/dense/bias", "router_0/dense/kernel"]
    x = videos(seed=7)
    # Same weights and ops at full width, except the token grouping: <= 1e-5 in float32.
    assert max_abs_diff(to_numpy(mone(x)), to_numpy(dense(x))) <= 1e-5


@pytest.mark.parametrize("use_class_token", [True, False])
def test_central_frame_inflation_reproduces_the_image_model_on_a_static_clip(use_class_token):
    image = built(ViTBackbone(**SPATIAL, use_class_token=use_class_token))
    randomize_weights(image, seed=8)
    video = vivit_from_image_backbone(
        image, num_frames=4, tubelet_size=2, temporal_depth=1, use_class_token=use_class_token
    )
    frame = videos(batch=BATCH, frames=1, seed=9)[:, 0]
    static = np.repeat(frame[:, None], 4, axis=1)
    embedded = to_numpy(video.patch_embedding(static)).reshape(BATCH, 2, -1, 32)
    expected = to_numpy(image.patch_embedding(frame))
    for index in range(2):
        assert_f32_close(embedded[:, index], expected)
    # ... and the whole spatial transformer reproduces the image backbone per frame.
    spatial, _ = video.encode(video.patch_embedding(static))
    spatial = to_numpy(spatial).reshape(BATCH, 2, -1, 32)
    assert_f32_close(spatial[:, 1], to_numpy(image(frame)))


def test_central_frame_kernel_sees_only_the_central_frame():
    kernel = np.random.default_rng(0).standard_normal((8, 8, 3, 32)).astype("float32")
    central = inflate_patch_kernel(kernel, 3)
    assert central.shape == (3, 8, 8, 3, 32)
    np.testing.assert_array_equal(central[1], kernel)
    assert not central[0].any() and not central[2].any()
    average = inflate_patch_kernel(kernel, 2, method="average")
    np.testing.assert_allclose(average.sum(axis=0), kernel, rtol=1e-6)
    with pytest.raises(ValueError, match="method"):
        inflate_patch_kernel(kernel, 2, method="tile")
    # a moving clip: only frames t//2 = 1 and 3 reach the tokens
    layer = TubeletEmbedding(4, 16, 8, 32, tubelet_size=2, use_class_token=False)
    layer.build(None)
    layer.projection.kernel.assign(inflate_patch_kernel(kernel, 2))
    clip = videos(batch=1, seed=10)
    changed = clip.copy()
    changed[:, [0, 2]] += 1.0
    np.testing.assert_array_equal(to_numpy(layer(clip)), to_numpy(layer(changed)))


def test_mone_image_backbone_initialises_mone_vivit():
    image = built(MoNEViTBackbone(**SPATIAL, capacity=0.3, num_experts=4))
    randomize_weights(image, seed=11)
    video = vivit_from_image_backbone(image, num_frames=4, temporal_depth=1)
    assert isinstance(video, MoNEViViTBackbone)
    assert video.capacity == 0.3 and video.expert_capacities == image.expert_capacities
    source, target = relative_weights(image), relative_weights(video)
    for path in ("router_0/dense/kernel", "block_1/alpha", "block_0/mlp/fc1/kernel", "norm/gamma"):
        np.testing.assert_array_equal(target[path], source[path])
    # a larger frame grid resizes the spatial position embeddings
    bigger = vivit_from_image_backbone(image, num_frames=4, temporal_depth=1, image_size=32)
    assert bigger.patch_embedding.position_embedding.shape == (1, 17, 32)


def test_load_image_weights_rejects_other_sizes_and_changes_nothing():
    image = built(ViTBackbone(**{**SPATIAL, "hidden_dim": 64}))
    video = built(ViViTBackbone(**VIDEO))
    before = relative_weights(video)
    with pytest.raises(ValueError, match="hidden_dim"):
        load_image_weights(video, image)
    after = relative_weights(video)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_video_classifier_round_trip_keeps_outputs_and_capacity(tmp_path):
    model = VideoClassifier(MoNEViViTBackbone(**VIDEO, capacity=0.4), num_classes=5)
    model.build()
    randomize_weights(model, seed=12)
    restored = run_serialization_roundtrip(model, videos(seed=13), tmp_path, atol=1e-6)
    assert restored.capacity == 0.4 and restored.backbone.expert_capacities == model.backbone.expert_capacities


def test_dense_video_classifier_round_trip(tmp_path):
    model = VideoClassifier(ViViTBackbone(**VIDEO, use_class_token=False), num_classes=3, pooling="gap")
    model.build()
    randomize_weights(model, seed=14)
    run_serialization_roundtrip(model, videos(seed=15), tmp_path, atol=1e-6)


def test_short_fit_on_moving_digits_lowers_the_loss():
    # 16 epochs on 32 clean clips of the bundled task (digit labels): the model
    # fits them well below the loss of the zero-initialised head (ln 10 = 2.30)
    # and of predicting the label frequencies of these clips (>= 2.1).
    x, y = load_moving_digits(
        num_frames=4, image_size=16, digit_scale=1, clutter=0, noise=0.0, target="digit", split="train"
    )
    x, y = x[:32], y[:32]
    frequencies = np.bincount(y, minlength=10) / len(y)
    prior_loss = -np.sum(frequencies[frequencies > 0] * np.log(frequencies[frequencies > 0]))
    model = VideoClassifier(MoNEViViTBackbone(**VIDEO, capacity=0.5), num_classes=10)
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = model.fit(x, y, batch_size=8, epochs=16, verbose=0, shuffle=False)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < min(losses[0], prior_loss) - 0.15, (losses, prior_loss)


@pytest.mark.parametrize(
    "shape, match",
    [
        ((1, 6, 16, 16, 3), "frames"),
        ((1, 4, 24, 24, 3), "image_size"),
        ((1, 4, 16, 16, 1), "channels"),
        ((1, 16, 16, 3), "videos"),
    ],
)
def test_wrong_videos_at_call_time(shape, match):
    model = built(MoNEViViTBackbone(**VIDEO))
    with pytest.raises(ValueError, match=match):
        model(np.zeros(shape, "float32"))


def test_constructor_errors():
    with pytest.raises(ValueError, match="num_frames"):
        ViViTBackbone(**{**VIDEO, "num_frames": 5})
    with pytest.raises(ValueError, match="tubelet_size"):
        ViViTBackbone(**{**VIDEO, "tubelet_size": 0})
    with pytest.raises(ValueError, match="pooling"):
        VideoClassifier(ViViTBackbone(**VIDEO, use_class_token=False), pooling="token")


def test_flops_of_a_tiny_vivit_by_hand():
    dense = ViViTBackbone(**VIDEO)
    count = keras_mone.flops(dense)
    d, mlp = 32, 64
    spatial_block = 5 * d * 3 * d + 2 * 5 * 5 * d + 5 * d * d + 2 * 5 * d * mlp
    temporal_block = 3 * d * 3 * d + 2 * 3 * 3 * d + 3 * d * d + 2 * 3 * d * mlp
    expected = 2 * 4 * (2 * 8 * 8 * 3) * d + 2 * 2 * spatial_block + temporal_block
    assert count.total == expected
    assert count.breakdown["temporal"] == temporal_block
    # MoNE: per frame index, the routed blocks cost the groups at their widths
    mone = MoNEViViTBackbone(**VIDEO, capacity=0.5)
    counts, dropped = mone.expert_token_counts()
    groups = [(k, w) for k, w in zip(counts, mone.expert_widths) if k]
    block = sum(vit_block_macs(groups, d, mlp).values())
    mone_expected = 2 * 4 * (2 * 8 * 8 * 3) * d + 2 * (2 * block + 5 * d * 4) + temporal_block
    assert keras_mone.flops(mone).total == mone_expected
    classifier = VideoClassifier(mone, num_classes=7)
    assert keras_mone.flops(classifier).total == mone_expected + d * 7


@pytest.mark.parametrize("name, gmacs", [("vivit_fe_b16", 283), ("vivit_fe_b16_ssv2", 374)])
def test_vivit_b16_flops_match_the_published_analytic_counts(name, gmacs):
    spec = presets.get_preset(name)
    config = {k: v for k, v in spec.items() if k not in ("description", "architecture", "variant", "num_classes")}
    backbone = ViViTBackbone(**keras_mone.models.decode_variant(spec["variant"]), **config)  # not built
    assert abs(keras_mone.flops(backbone).gmacs - gmacs) / gmacs < 0.02


def test_small_video_presets_build_and_run():
    model = presets.from_preset("mone_vivit_fe_digits", load_weights=False, capacity=0.3)
    assert isinstance(model, VideoClassifier) and isinstance(model.backbone, MoNEViViTBackbone)
    assert model.capacity == 0.3
    clip = np.zeros((1, 8, 32, 32, 3), "float32")
    assert to_numpy(model(clip)).shape == (1, 40)
    dense = presets.from_preset("vivit_fe_digits", load_weights=False)
    assert keras_mone.flops(dense).total > keras_mone.flops(model).total


def test_transfer_between_backbones_built_inside_classifiers():
    # A backbone built by its classifier has weight paths under the classifier's
    # name; transfer_weights and load_image_weights see paths relative to the backbone.
    dense = VideoClassifier(ViViTBackbone(**VIDEO), num_classes=3, name="dense_clips")
    mone = VideoClassifier(MoNEViViTBackbone(**VIDEO, capacity=1.0), num_classes=3, name="mone_clips")
    dense.build()
    mone.build()
    assert dense.backbone.weights[0].path.startswith("dense_clips/")
    randomize_weights(dense, seed=16)
    assert transfer_weights(dense.backbone, mone.backbone)[0] == "block_0/alpha"
    x = videos(seed=17)
    assert max_abs_diff(to_numpy(mone.backbone(x)), to_numpy(dense.backbone(x))) <= 1e-5
    from keras_mone.models import ImageClassifier

    image = ImageClassifier(ViTBackbone(**SPATIAL), num_classes=3, name="frames")
    image.build()
    load_image_weights(dense.backbone, image.backbone)
