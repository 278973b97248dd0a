"""Training utilities: schedule, kernels-only weight decay, losses, data layers, modes."""

import math

import keras
import numpy as np
import pytest

from conftest import TINY, to_numpy
from keras_mone.data.augment import InceptionCrop, RolledMixUp
from keras_mone.models import ImageClassifier, MoNEViTBackbone, ViTBackbone
from keras_mone.training import SigmoidCrossEntropy, WarmupCosineDecay, adamw_kernels_only, isoflops_epochs
from keras_mone.training.router_monitor import router_statistics


def test_schedule_warmup_and_end():
    schedule = WarmupCosineDecay(1e-3, total_steps=100, warmup_steps=10, end_learning_rate=1e-5)
    lr = lambda s: float(to_numpy(schedule(s)))  # noqa: E731
    assert lr(0) == pytest.approx(1e-4)
    assert lr(4) == pytest.approx(5e-4)
    assert lr(9) == pytest.approx(1e-3)
    assert lr(10) == pytest.approx(1e-3)
    assert lr(55) == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * 0.5)), rel=1e-5)
    assert lr(100) == pytest.approx(1e-5)
    assert lr(500) == pytest.approx(1e-5)


def test_weight_decay_reaches_kernels_only():
    model = ImageClassifier(MoNEViTBackbone(**TINY), num_classes=3, head_bias_init=0.5)
    model.build()
    for v in model.trainable_variables:  # every weight non-zero, so decay would show
        v.assign(np.full(v.shape, 0.5 if v.path.endswith("alpha") else 1.0, "float32"))
    optimizer = adamw_kernels_only(1e-2, total_steps=10, warmup_steps=0, weight_decay=0.1)
    # Zero gradients: Adam moves nothing, so any change is weight decay.
    optimizer.apply_gradients([(keras.ops.zeros(v.shape), v) for v in model.trainable_variables])
    decayed = [v.path for v in model.trainable_variables if not np.allclose(to_numpy(v), 1.0) and not v.path.endswith("alpha")]
    kernels = [v.path for v in model.trainable_variables if v.path.endswith("/kernel")]
    assert sorted(decayed) == sorted(kernels)
    for v in model.trainable_variables:
        if v.path.endswith("/kernel"):
            np.testing.assert_allclose(to_numpy(v), 1.0 - 1e-2 * 0.1, rtol=1e-6)


def test_sigmoid_cross_entropy_sums_over_classes():
    logits = np.array([[2.0, -1.0, 0.5], [-30.0, 40.0, 0.0]], "float32")
    labels = np.array([[1.0, 0.0, 0.0], [0.2, 0.8, 0.0]], "float32")
    p = 1 / (1 + np.exp(-logits.astype(np.float64)))
    expected = -(labels * np.log(np.clip(p, 1e-300, 1)) + (1 - labels) * np.log(np.clip(1 - p, 1e-300, 1)))
    expected[1] = [0.2 * 30 + np.log1p(np.exp(-30)), 0.2 * 40 + np.log1p(np.exp(-40)), np.log(2)]
    actual = float(to_numpy(SigmoidCrossEntropy()(labels, logits)))
    np.testing.assert_allclose(actual, expected.sum(axis=1).mean(), rtol=1e-5)


def test_inception_crop_area_aspect_and_value_range():
    layer = InceptionCrop(16, 12, seed=3)
    top, left, h, w = (to_numpy(a) for a in layer.sample_boxes(2000, 40, 60))
    area, aspect = h * w / (40 * 60), w / h
    assert area.min() >= 0.05 - 1e-6 and area.max() <= 1.0 + 1e-6
    assert aspect.min() >= 0.75 - 1e-5 and aspect.max() <= 4 / 3 + 1e-5
    assert area.max() - area.min() > 0.8  # the whole range is used
    assert (top >= 0).all() and (left >= 0).all()
    assert (top + h <= 40 + 1e-3).all() and (left + w <= 60 + 1e-3).all()
    x = np.random.default_rng(0).uniform(-1, 1, (4, 40, 60, 3)).astype("float32")
    y = to_numpy(layer(x))
    assert y.shape == (4, 16, 12, 3)
    assert y.min() >= x.min() - 1e-6 and y.max() <= x.max() + 1e-6
    assert to_numpy(layer(x[0])).shape == (16, 12, 3)


def test_inception_crop_of_a_constant_box_is_exact():
    # A linear ramp stays a ramp: bilinear resizing of the cropped box samples
    # it at the box's half-pixel centres.
    ramp = np.tile(np.arange(32, dtype="float32")[None, :, None], (32, 1, 1))
    full = to_numpy(InceptionCrop(8, 8)(ramp[None], training=False))[0, 0, :, 0]
    np.testing.assert_allclose(full, (np.arange(8) + 0.5) * 4 - 0.5, atol=1e-5)


def test_inception_crop_in_tf_data():
    tf = pytest.importorskip("tensorflow")
    layer = InceptionCrop(8, 8, seed=0)
    ds = tf.data.Dataset.from_tensor_slices(np.ones((3, 20, 30, 3), "float32")).map(layer).batch(3)
    batch = next(iter(ds)).numpy()
    assert batch.shape == (3, 8, 8, 3)
    np.testing.assert_allclose(batch, 1.0)


def test_augmentation_in_tf_data_draws_fresh_randomness_per_element():
    # Under jax and torch the layers compute with TensorFlow inside tf.data
    # (their own tf.random stream); the draws must still differ per call.
    tf = pytest.importorskip("tensorflow")
    x = np.arange(4 * 2 * 2 * 1, dtype="float32").reshape(4, 2, 2, 1)
    y = np.eye(4, dtype="float32")
    mixup = RolledMixUp(alpha=0.8, seed=1)
    batches = list(tf.data.Dataset.from_tensors({"images": x, "labels": y}).repeat(3).map(mixup))
    weights = [float(b["labels"].numpy()[0, 0]) for b in batches]
    assert len(set(weights)) == 3 and all(0.5 <= w <= 1.0 for w in weights)
    for w, batch in zip(weights, batches):
        np.testing.assert_allclose(batch["labels"].numpy(), w * y + (1 - w) * np.roll(y, 1, axis=0), rtol=1e-6)
    ramp = np.tile(np.arange(32, dtype="float32")[None, :, None], (32, 1, 3))
    crop = InceptionCrop(8, 8, seed=0)
    crops = np.stack([c.numpy() for c in tf.data.Dataset.from_tensors(ramp).repeat(4).map(crop)])
    assert crops.shape == (4, 8, 8, 3) and crops.min() >= 0 and crops.max() <= 31
    assert len({c.tobytes() for c in crops}) == 4


def test_rolled_mixup_big_vision_semantics():
    layer = RolledMixUp(alpha=0.8, seed=1)
    x = np.arange(4 * 2 * 2 * 1, dtype="float32").reshape(4, 2, 2, 1)
    y = np.eye(4, dtype="float32")
    out = layer({"images": x, "labels": y})
    labels = to_numpy(out["labels"])
    weight = labels[0, 0]
    assert 0.5 <= weight <= 1.0
    np.testing.assert_allclose(labels, weight * y + (1 - weight) * np.roll(y, 1, axis=0), rtol=1e-6)
    np.testing.assert_allclose(to_numpy(out["images"]), weight * x + (1 - weight) * np.roll(x, 1, axis=0), rtol=1e-5)
    same = layer({"images": x, "labels": y}, training=False)
    np.testing.assert_array_equal(to_numpy(same["labels"]), y)


def test_isoflops_epochs_follow_the_flop_ratio():
    mone = MoNEViTBackbone(capacity=0.25, **TINY)
    from keras_mone.analysis import flops

    ratio = flops(ViTBackbone(**TINY)).total / flops(mone).total
    assert ratio > 1.2
    assert isoflops_epochs(10, mone) == round(10 * ratio)
    assert isoflops_epochs(10, MoNEViTBackbone(capacity=1.0, **TINY)) == 10
    # adaptive: the mean MoNE cost over the drawn capacities; capacity restored
    low, high = flops(mone).total, flops(MoNEViTBackbone(capacity=0.75, **TINY)).total
    dense = flops(ViTBackbone(**TINY)).total
    assert isoflops_epochs(10, mone, [0.25, 0.75]) == round(10 * dense / ((low + high) / 2))
    assert mone.capacity == 0.25


def test_router_statistics_report_alpha_and_entropy():
    backbone = MoNEViTBackbone(capacity=0.5, router_positions=(0, 1), **TINY)
    backbone.build()
    images = np.random.default_rng(0).uniform(-1, 1, (4, 32, 32, 3)).astype("float32")
    backbone.blocks[1].alpha.assign(0.25)
    stats = router_statistics(backbone, images)
    assert stats["alpha_0"] == 0.0 and stats["alpha_1"] == 0.25
    # Routers start near uniform (weights ~ N(0, 0.02)): entropy just below ln 4.
    for position in (0, 1):
        assert math.log(4) - 0.05 < stats[f"router_entropy_{position}"] <= math.log(4) + 1e-9
    backbone.routers[0].dense.kernel.assign(np.full((32, 4), 0.0, "float32"))
    backbone.routers[0].dense.bias.assign(np.array([0.0, 0.0, 0.0, 30.0], "float32"))
    assert router_statistics(backbone, images)["router_entropy_0"] < 1e-6  # one-hot router
    assert router_statistics(ViTBackbone(**TINY), images) == {}  # nothing to monitor


def test_router_columns_reach_history_csv(tmp_path):
    import csv

    from keras_mone import recipes
    from recipe_helpers import tiny_overrides

    setup = recipes.load("cluttered_digits_mone", **tiny_overrides(tmp_path, epochs=2, steps_per_epoch=2))
    setup.fit(verbose=0)
    with open(tmp_path / "history.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    for row in rows:
        assert 0.0 <= float(row["alpha_0"]) < 1.0
        assert 0.0 <= float(row["router_entropy_0"]) <= math.log(4) + 1e-6
