"""Bad inputs and failing loops leave a model usable (issue 13, items 4, 5, 7, 9).

On jax, Keras' loops detach the variables while they run; a wrong input used
to leave every variable empty. Inputs handed to ``fit`` / ``evaluate`` /
``predict`` are checked before any tracing, on every backend.
"""

import keras
import numpy as np
import pytest

from conftest import TINY, TINY_VIDEO, images, videos
from keras_mone import models

NUM_CLASSES = 10


def tiny_mone(capacity=0.3):
    backbone = models.MoNEViTBackbone(**TINY, capacity=capacity)
    return models.ImageClassifier(backbone, num_classes=NUM_CLASSES)


def tiny_video():
    return models.VideoClassifier(models.MoNEViViTBackbone(**TINY_VIDEO, capacity=0.5), num_classes=NUM_CLASSES)


def assert_usable(model, inputs, expected, tmp_path):
    np.testing.assert_array_equal(model.predict(inputs, verbose=0), expected)
    assert len(model.get_weights()) == len(model.weights)
    path = str(tmp_path / "after.keras")
    model.save(path)
    np.testing.assert_allclose(keras.saving.load_model(path).predict(inputs, verbose=0), expected, atol=1e-6)


@pytest.mark.parametrize(
    "bad, message",
    [
        (np.zeros((2, 16, 16, 3), "float32"), "image_size"),
        (np.zeros((2, 32, 32, 1), "float32"), "num_channels"),
        (np.zeros((2, 32, 32, 3), "uint8"), "floating point"),
        (np.zeros((32, 32, 3), "float32"), r"\(batch, height, width, channels\)"),
    ],
)
def test_a_bad_input_is_refused_and_the_model_stays_usable(bad, message, tmp_path):
    model = tiny_mone()
    x = images()
    expected = model.predict(x, verbose=0)
    with pytest.raises(ValueError, match=message):
        model.predict(bad, verbose=0)
    model.compile(optimizer="sgd", loss="categorical_crossentropy")
    with pytest.raises(ValueError, match=message):
        model.fit(bad, np.zeros((len(bad), NUM_CLASSES)), verbose=0)
    with pytest.raises(ValueError, match=message):
        model.evaluate(bad, np.zeros((len(bad), NUM_CLASSES)), verbose=0)
    assert_usable(model, x, expected, tmp_path)


def test_a_bad_clip_is_refused_by_the_video_model():
    model = tiny_video()
    with pytest.raises(ValueError, match="num_frames"):
        model.predict(videos(frames=2), verbose=0)
    assert model.predict(videos(), verbose=0).shape == (2, NUM_CLASSES)


def test_a_failing_callback_leaves_the_model_usable(tmp_path):
    class FailsAtSecondBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise RuntimeError("callback failed")

    model = tiny_mone()
    model.compile(optimizer="sgd", loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    x = images(batch=8)
    y = np.eye(NUM_CLASSES, dtype="float32")[np.arange(8)]
    with pytest.raises(RuntimeError, match="callback failed"):
        model.fit(x, y, batch_size=2, verbose=0, callbacks=[FailsAtSecondBatch()])
    # the two steps that ran are kept; the model predicts, saves and trains on
    trained = model.predict(x, verbose=0)
    assert np.isfinite(trained).all()
    assert_usable(model, x, trained, tmp_path)
    model.fit(x, y, batch_size=4, verbose=0)


def test_zero_images_give_zero_predictions():
    model = tiny_mone()
    empty = np.zeros((0, TINY["image_size"], TINY["image_size"], 3), "float32")
    out = model.predict(empty, verbose=0)
    assert out.shape == (0, NUM_CLASSES) and out.dtype == np.float32
    assert model.backbone.predict(empty, verbose=0).shape == (0, model.backbone.num_tokens, TINY["hidden_dim"])


def test_zero_examples_cannot_train_or_evaluate():
    # Issue 24, item 10: jax raised a bare StopIteration, torch a build error, tensorflow nothing.
    model = tiny_mone()
    model.compile(optimizer="sgd", loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    x = images()
    expected = model.predict(x, verbose=0)
    empty = np.zeros((0, TINY["image_size"], TINY["image_size"], 3), "float32")
    for loop, kwargs in (("fit", dict(verbose=0)), ("evaluate", dict(verbose=0)), ("train_on_batch", {}), ("test_on_batch", {})):
        with pytest.raises(ValueError, match=rf"{loop}: argument 'x' holds 0 examples.*at least one example"):
            getattr(model, loop)(empty, np.zeros((0, NUM_CLASSES), "float32"), **kwargs)
    np.testing.assert_array_equal(model.predict(x, verbose=0), expected)


@pytest.mark.parametrize("bad", [np.nan, 3e38])
def test_a_non_finite_image_does_not_break_the_batch(bad):
    # Issue 13 item 5: on tensorflow a NaN image made routing take tokens twice.
    model = tiny_mone()
    x = images(batch=4)
    clean = model.predict(x[:3], verbose=0)
    x[3] = bad
    out = model.predict(x, verbose=0)
    np.testing.assert_allclose(out[:3], clean, atol=1e-5)


def test_tied_router_scores_route_by_token_index():
    # All-zero images: every token identical up to its position embedding; with
    # position embeddings zeroed every router probability ties exactly.
    model = tiny_mone(capacity=0.5)
    model.build()
    embedding = model.backbone.patch_embedding
    embedding.position_embedding.assign(np.zeros(embedding.position_embedding.shape, "float32"))
    _, intermediates = model.backbone(images() * 0.0, return_intermediates=True)
    assignment = keras.ops.convert_to_numpy(intermediates["expert_index"][0])
    counts, _ = model.backbone.expert_token_counts()
    expected = np.repeat(np.arange(len(counts))[::-1], counts[::-1])
    np.testing.assert_array_equal(assignment[0], expected)


def test_realised_capacity_is_reported():
    with pytest.warns(UserWarning, match="realised as 0.781"):
        backbone = models.MoNEViTBackbone(**dict(TINY, patch_size=16), capacity=0.9)
    assert backbone.capacity == 0.9
    assert backbone.realised_capacity == pytest.approx(0.78125)
    model = models.ImageClassifier(models.MoNEViTBackbone(**TINY, capacity=0.3), num_classes=2)
    assert abs(model.realised_capacity - 0.3) <= 0.02
    assert models.ImageClassifier(models.ViTBackbone(**TINY), num_classes=2).realised_capacity == 1.0
