"""One test routine every architecture of the method registry goes through.

``run_backbone_test(architecture)`` builds the architecture's backbone and
classifier at a tiny size (``TINY`` / ``TINY_VIDEO``) and checks what a user
of any Keras model relies on: output shapes, the config round trip, the
``.keras`` round trip (same outputs), one training step that moves the
weights and keeps the loss finite, a forward pass under the
``mixed_bfloat16`` policy, and a clear error for inputs of the wrong size.
A method added to the registry is tested by it with no new test code.
"""

import keras
import numpy as np
import pytest
from conftest import BATCH, images, randomize_weights, to_numpy, videos

from keras_mone.models import forward_with_record
from keras_mone.methods.registry import architectures
from keras_mone.training import SumOverWidths

NUM_CLASSES = 3


def tiny_config(architecture):
    """The architecture's own tiny configuration (its registry entry's ``tiny_config``)."""
    return architecture.tiny_config


def tiny_inputs(architecture, seed=0):
    if architecture.video:
        return videos(seed=seed)
    config = architecture.tiny_config
    return images(seed=seed, size=config["image_size"], channels=config.get("num_channels", 3))


def build_classifier(name, dtype=None):
    architecture = architectures()[name]
    extra = {} if dtype is None else {"dtype": dtype}
    backbone = architecture.build_backbone(**tiny_config(architecture), **extra)
    model = architecture.task(backbone, num_classes=NUM_CLASSES, **extra)
    model.build()
    randomize_weights(model, seed=1)
    return model


def deterministic(model):
    """Random routers draw anew on every call; everything else is a function of the inputs."""
    return getattr(model.backbone, "router_type", "learned") != "random"


def check_compiled_record(backbone, x, exact=True):
    """``forward_with_record`` gives the eager ``return_intermediates=True`` call's
    tokens and record (same structure; same values when the backbone is deterministic:
    integer leaves equal, float leaves within float32 reordering of a compiled graph)."""
    compiled = forward_with_record(backbone, x)
    eager = keras.tree.map_structure(to_numpy, backbone(x, training=False, return_intermediates=True))
    keras.tree.assert_same_structure(compiled, eager)
    for got, want in zip(keras.tree.flatten(compiled), keras.tree.flatten(eager)):
        assert got.shape == want.shape and got.dtype == want.dtype
        if not exact:
            continue
        if np.issubdtype(want.dtype, np.floating):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(got, want)


def run_backbone_test(name, tmp_path):
    architecture = architectures()[name]
    x = tiny_inputs(architecture)
    model = build_classifier(name)
    backbone = model.backbone

    # Shapes: the classifier's logits and the backbone's declared output shape.
    logits = to_numpy(model(x))
    assert logits.shape == (BATCH, NUM_CLASSES) and np.isfinite(logits).all()
    features = backbone(x)
    assert tuple(features.shape) == tuple(backbone.compute_output_shape(x.shape))

    # The compiled forward record that analyses read: the eager call's, leaf for leaf.
    check_compiled_record(backbone, x, exact=deterministic(model))

    # Config round trip: the same config, hence the same architecture.
    config = backbone.get_config()
    assert type(backbone).from_config(config).get_config() == config

    # .keras round trip: the same outputs (bit for bit) from the loaded model.
    path = tmp_path / f"{name}.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, compile=False)
    assert type(loaded.backbone) is type(backbone) and loaded.backbone.get_config() == config
    if deterministic(model):
        np.testing.assert_array_equal(to_numpy(loaded(x)), to_numpy(model(x)))

    # One training step: finite loss, weights move.
    before = [to_numpy(w).copy() for w in model.trainable_weights]
    loss = keras.losses.CategoricalCrossentropy(from_logits=True)
    if getattr(model, "joint_training", False):  # MatViT: logits of every width, losses summed
        loss = SumOverWidths(loss)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    labels = keras.ops.one_hot(np.arange(BATCH) % NUM_CLASSES, NUM_CLASSES)
    history = model.fit(x, labels, epochs=1, batch_size=BATCH, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert any(not np.array_equal(b, to_numpy(w)) for b, w in zip(before, model.trainable_weights))

    # Mixed precision: bfloat16 compute, finite outputs.
    low = build_classifier(name, dtype="mixed_bfloat16")
    out = low(tiny_inputs(architecture))
    assert np.isfinite(to_numpy(keras.ops.cast(out, "float32"))).all()

    # Bad input: the wrong spatial size is refused with the argument named.
    wrong = x[..., :-1, :-1, :] if not architecture.video else x[:, :, :-1, :-1, :]
    with pytest.raises(ValueError, match="size"):
        model.predict(wrong, verbose=0)
