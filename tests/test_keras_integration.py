"""keras_mone layers and models where Keras users put them (issue 15, item 5):
functional models, mixed precision, and export for serving."""

import keras
import numpy as np
import pytest

from conftest import BACKEND, TINY, TINY_VIDEO, images, randomize_weights, to_numpy, videos
from keras_mone import layers, models

D = TINY["hidden_dim"]

LAYERS = {
    "NestedDense": lambda: layers.NestedDense(16),
    "NestedMLP": lambda: layers.NestedMLP(D, 2 * D),
    "MoNEAttention": lambda: layers.MoNEAttention(D, 4),
    "ViTBlock": lambda: layers.ViTBlock(D, 4, 2 * D),
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


def _served_model(capacity, video=False):
    """A classifier built (not called, as from_preset or load_model leave it) with random weights."""
    if video:
        model = models.VideoClassifier(models.MoNEViViTBackbone(**TINY_VIDEO, capacity=capacity), num_classes=5)
    else:
        model = models.ImageClassifier(models.MoNEViTBackbone(**TINY, capacity=capacity), num_classes=5)
    model.build()
    randomize_weights(model)  # the head starts at zero: outputs would be all zeros
    return model


@pytest.mark.skipif(BACKEND == "torch", reason="Keras exports torch models with torch.export, not to a TF SavedModel")
@pytest.mark.parametrize("capacity, video", [(0.5, False), (1.0, False), (0.5, True)])
def test_exported_classifier_serves_the_same_outputs(capacity, video, tmp_path):
    tf = pytest.importorskip("tensorflow")
    model = _served_model(capacity, video)
    x = videos() if video else images()
    model.export(str(tmp_path / "served"), format="tf_saved_model", verbose=False)  # no call before
    expected = model.predict(x, verbose=0)
    assert np.abs(expected).max() > 1e-2
    served = tf.saved_model.load(str(tmp_path / "served"))
    np.testing.assert_allclose(np.asarray(served.serve(tf.constant(x))), expected, atol=1e-5)
    # a backbone exports too
    model.backbone.export(str(tmp_path / "backbone"), format="tf_saved_model", verbose=False)
    served_backbone = tf.saved_model.load(str(tmp_path / "backbone"))  # keep it: it owns the variables
    features = served_backbone.serve(tf.constant(x))
    np.testing.assert_allclose(np.asarray(features), to_numpy(model.backbone(x)), atol=1e-5)


@pytest.mark.skipif(BACKEND != "torch", reason="ONNX export needs tf2onnx (jax, tensorflow), which the test extras "
                    "do not install: its pins clash with tensorflow's, and TF's exact GELU has no ONNX op")
@pytest.mark.parametrize("capacity", [0.5, 1.0])
def test_onnx_export_serves_the_same_outputs(capacity, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    model = _served_model(1.0)
    model.backbone.set_capacity(capacity)  # exported at the capacity the model runs at
    x = images()
    expected = model.predict(x, verbose=0)
    assert np.abs(expected).max() > 1e-2
    path = str(tmp_path / "served.onnx")
    # A static batch: torch's dynamo exporter (a dynamic batch falls back to TorchScript tracing)
    model.export(path, format="onnx", verbose=False, input_signature=[keras.InputSpec(shape=x.shape, dtype="float32")])
    session = ort.InferenceSession(path)
    served = session.run(None, {session.get_inputs()[0].name: x})[0]
    np.testing.assert_allclose(served, expected, atol=1e-5)
    if capacity < 1.0:  # the served graph is not the full-capacity one
        model.backbone.set_capacity(1.0)
        assert np.abs(model.predict(x, verbose=0) - served).max() > 1e-4
    # without a signature: one example per call
    model.backbone.set_capacity(capacity)
    model.export(path, format="onnx", verbose=False)
    session = ort.InferenceSession(path)
    assert session.get_inputs()[0].shape == [1, *model.backbone.input_shape_per_example]
    np.testing.assert_allclose(session.run(None, {session.get_inputs()[0].name: x[:1]})[0], expected[:1], atol=1e-5)


@pytest.mark.skipif(BACKEND != "torch", reason="the [onnx] extra is needed for ONNX export on torch only")
def test_onnx_export_without_the_extra_names_it(monkeypatch, tmp_path):
    # Issue 24 item 8: without onnx / onnxscript Keras falls back to TorchScript
    # tracing, which breaks routing; the error must name the extra instead.
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxscript" else real(name, *a))
    model = _served_model(1.0)
    with pytest.raises(ImportError, match=r"onnxscript.*keras-mone\[onnx\]"):
        model.export(str(tmp_path / "served.onnx"), format="onnx", verbose=False)
    assert not (tmp_path / "served.onnx").exists()


@pytest.mark.parametrize("name", ["vit", "mone_vit"])
def test_a_saved_compiled_model_loads_compiled(name, tmp_path):
    """A run's model.keras evaluates and resumes training after loading: compile(),
    the optimizer and its state come back (Keras skips models that override compile)."""
    from harness import build_classifier

    model = build_classifier(name)
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss=keras.losses.CategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    x, y = images(seed=3), keras.ops.one_hot(np.arange(len(images(seed=3))) % 3, 3)
    model.fit(x, y, epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert int(to_numpy(loaded.optimizer.iterations)) == 1
    for saved, restored in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(to_numpy(restored), to_numpy(saved))
    expected = model.evaluate(x, y, verbose=0, return_dict=True)
    got = loaded.evaluate(x, y, verbose=0, return_dict=True)
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6)
