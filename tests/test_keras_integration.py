"""keras_mone layers and models where Keras users put them (issue 15, item 5):
functional models, mixed precision, and export for serving."""

import keras
import numpy as np
import pytest

from conftest import BACKEND, TINY, images, to_numpy
from keras_mone import layers, models

D = TINY["hidden_dim"]

LAYERS = {
    "NestedDense": lambda: layers.NestedDense(16),
    "NestedMLP": lambda: layers.NestedMLP(D, 2 * D),
    "MoNEAttention": lambda: layers.MoNEAttention(D, 4),
    "MoNEBlock": lambda: layers.MoNEBlock(D, 4, 2 * D),
    "Router": lambda: layers.Router(4),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_in_a_functional_model(name):
    layer = LAYERS[name]()
    inputs = keras.Input((10, D))
    model = keras.Model(inputs, layer(inputs))
    x = np.random.default_rng(0).normal(size=(2, 10, D)).astype("float32")
    out = to_numpy(model(x))
    np.testing.assert_allclose(out, to_numpy(layer(x)), atol=1e-6)  # same layer, same weights
    assert tuple(model.output.shape[1:]) == out.shape[1:]


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_under_mixed_precision(name):
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        layer = LAYERS[name]()
        inputs = keras.Input((10, D))
        symbolic = layer(inputs)
        out = layer(np.random.default_rng(0).normal(size=(2, 10, D)).astype("float32"))
    finally:
        keras.config.set_dtype_policy("float32")
    # Router returns float32 probabilities on purpose (routing must not depend on the compute dtype)
    expected = "float32" if name == "Router" else "bfloat16"
    assert keras.backend.standardize_dtype(out.dtype) == expected
    assert keras.backend.standardize_dtype(symbolic.dtype) == expected
    assert np.isfinite(to_numpy(keras.ops.cast(out, "float32"))).all()


@pytest.mark.skipif(BACKEND == "torch", reason="Keras exports torch models with torch.export, not to a TF SavedModel")
@pytest.mark.parametrize("capacity", [0.5, 1.0])
def test_exported_classifier_serves_the_same_outputs(capacity, tmp_path):
    tf = pytest.importorskip("tensorflow")
    model = models.ImageClassifier(models.MoNEViTBackbone(**TINY, capacity=capacity), num_classes=5)
    x = images()
    expected = model.predict(x, verbose=0)
    model.export(str(tmp_path / "served"), format="tf_saved_model", verbose=False)
    served = tf.saved_model.load(str(tmp_path / "served"))
    np.testing.assert_allclose(np.asarray(served.serve(tf.constant(x))), expected, atol=1e-5)
