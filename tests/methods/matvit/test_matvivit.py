"""MatViT-ViViT: the nested-width video baseline MoNE-ViViT starts from (MoNE Sec. 4.4)."""

import keras
import numpy as np
import pytest

from conftest import (
    TINY_SPATIAL as SPATIAL,
    TINY_VIDEO as VIDEO,
    assert_f32_close,
    randomize_weights,
    relative_weights,
    to_numpy,
    videos,
)
from keras_mone import flops, presets, recipes
from keras_mone.models import (
    MatViViTBackbone,
    MatViViTClassifier,
    MoNEViViTBackbone,
    VideoClassifier,
    ViViTBackbone,
    transfer_weights,
)
from keras_mone.models.weight_transfer import relative_weight_paths
from keras_mone.training import SumOverWidths
from numpy_reference import vivit_forward


def built(model, seed):
    model.build()
    randomize_weights(model, seed=seed)
    return model


def test_full_width_equals_dense_vivit():
    matvivit = built(MatViViTBackbone(**VIDEO), seed=1)
    dense = ViViTBackbone(**VIDEO)
    dense.build()
    assert transfer_weights(matvivit, dense) == []  # the same layout, weight for weight
    x = videos()
    assert_f32_close(to_numpy(matvivit(x)), to_numpy(dense(x)))


@pytest.mark.parametrize("fraction, expert", [(0.125, 0), (0.5, 2)])
def test_nested_width_matches_the_numpy_reference(fraction, expert):
    # Every spatial token at width d = MoNE's expert of width d for all tokens,
    # gate factor 1 (alpha = 0); the temporal transformer stays at full width.
    matvivit = built(MatViViTBackbone(**VIDEO, width_fraction=fraction), seed=2)
    x = videos(seed=3)
    weights = relative_weights(matvivit)
    weights.update({f"block_{i}/alpha": 0.0 for i in range(VIDEO["depth"])})
    frames = VIDEO["num_frames"] // VIDEO["tubelet_size"]
    assignment = np.full((2 * frames, matvivit.num_tokens), expert)
    expected = vivit_forward(
        weights, x, depth=2, temporal_depth=1, num_heads=4,
        router_positions=(0,), expert_index=(assignment,), learned_router=False,
    )
    assert_f32_close(to_numpy(matvivit(x)), expected)


def test_joint_training_stacks_the_widths_and_sums_their_losses():
    model = built(MatViViTClassifier(MatViViTBackbone(**VIDEO), num_classes=5, head_bias_init=0.1), seed=4)
    x, labels = videos(seed=5), keras.ops.one_hot(np.array([1, 3]), 5)
    stacked = model(x, training=True)
    assert tuple(stacked.shape) == (2, 4, 5)
    ce = keras.losses.CategoricalCrossentropy(from_logits=True)
    expected = 0.0
    for w, fraction in enumerate(model.backbone.nested_fractions):
        model.set_width(fraction)
        logits = model(x, training=False)
        assert_f32_close(to_numpy(stacked[:, w]), to_numpy(logits))
        expected += float(to_numpy(ce(labels, logits)))
    loss = SumOverWidths(keras.losses.CategoricalCrossentropy(from_logits=True))
    np.testing.assert_allclose(float(to_numpy(loss(labels, stacked))), expected, rtol=1e-5)


def test_flops_nest_the_spatial_transformer_only():
    dense = flops(ViViTBackbone(**VIDEO)).breakdown
    narrow = flops(MatViViTBackbone(**VIDEO, width_fraction=0.125)).breakdown
    for name in ("qkv", "attention_output", "mlp"):
        assert narrow[name] * 8 == dense[name]
    for name in ("patch_embedding", "attention", "temporal"):
        assert narrow[name] == dense[name]


def test_round_trip_keeps_the_width(tmp_path):
    model = built(MatViViTClassifier(MatViViTBackbone(**VIDEO), num_classes=3), seed=6)
    model.set_width(0.25)
    x = videos(seed=7)
    expected = to_numpy(model(x))
    model.save(str(tmp_path / "m.keras"))
    restored = keras.saving.load_model(str(tmp_path / "m.keras"))
    assert type(restored) is MatViViTClassifier and restored.backbone.width_fraction == 0.25
    np.testing.assert_array_equal(to_numpy(restored(x)), expected)


def test_preset_builds_and_its_weights_fit_mone_vivit():
    matvivit = presets.from_preset("matvivit_fe_digits", load_weights=False)
    mone = presets.from_preset("mone_vivit_fe_digits", load_weights=False)
    x = np.zeros((1, 8, 32, 32, 3), "float32")
    matvivit(x), mone(x)
    assert type(matvivit) is MatViViTClassifier and flops(matvivit).gmacs == pytest.approx(0.0605, abs=1e-4)
    left = transfer_weights(matvivit, mone)  # head included: only MoNE's own weights stay new
    assert left and all("router" in p or p.endswith("alpha") for p in left)


def test_recipe_trains_jointly_and_initialises_mone_vivit(tmp_path):
    pytest.importorskip("tensorflow")
    tiny = dict(
        num_frames=4, image_size=16, digit_scale=1, model_args=dict(SPATIAL, depth=1, temporal_depth=1),
        samples_per_digit=1, test_samples_per_digit=1, epochs=1, steps_per_epoch=10, batch_size=8,
        eval_batch_size=64, warmup_fraction=0.0, checkpoint_steps=0, eval_split="", learning_rate=3e-3,
        init_from="",
    )
    setup = recipes.load("moving_digits_matvivit", resume=False, output_dir=str(tmp_path / "mat"), **tiny)
    assert type(setup.model) is MatViViTClassifier and setup.model.joint_training
    batch = next(setup.train_data)

    def one_batch():
        while True:
            yield batch

    one_batch = one_batch()
    before = setup.model.evaluate(*batch, verbose=0, return_dict=True)["loss"]  # full width
    setup.model.fit(one_batch, steps_per_epoch=10, epochs=1, verbose=0, shuffle=False)
    after = setup.model.evaluate(*batch, verbose=0, return_dict=True)["loss"]
    assert np.isfinite(after) and after < before - 0.05, (before, after)
    path = str(tmp_path / "matvivit.keras")
    setup.model.save(path)
    mone = recipes.load(
        "moving_digits_mone_vivit", resume=False, output_dir=str(tmp_path / "mone"), **{**tiny, "init_from": path}
    ).model
    assert type(mone.backbone) is MoNEViViTBackbone
    source, target = relative_weight_paths(setup.model), relative_weight_paths(mone)
    for name, value in source.items():  # every weight copied, the head included
        np.testing.assert_array_equal(to_numpy(target[name]), to_numpy(value))
    # A video model of another size is rejected before training.
    other = VideoClassifier(ViViTBackbone(**{**VIDEO, "hidden_dim": 16}), num_classes=40)
    other.build()
    other.save(str(tmp_path / "other.keras"))
    with pytest.raises(recipes.RecipeError, match="init_from"):
        recipes.load(
            "moving_digits_mone_vivit", resume=False, output_dir=str(tmp_path / "x"),
            **{**tiny, "init_from": str(tmp_path / "other.keras")},
        )
