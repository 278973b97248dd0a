"""LayerNorm statistics forms (``$KERAS_MONE_STATISTICS``, ``layers.layer_norm``): each equals
Keras' ``LayerNormalization`` within float rounding, alone and inside a MoNE model, on
jax; every other backend runs Keras' layer whatever the switch says."""

import keras
import numpy as np
import pytest
from conftest import BACKEND, TINY, assert_f32_close, to_numpy

from keras_mone import models
from keras_mone.layers import platform_forms
from keras_mone.layers.layer_norm import normalize

FORMS = platform_forms.STATISTICS_FORMS


def _layer(dtype="float32", **kwargs):
    layer = keras.layers.LayerNormalization(epsilon=1e-6, dtype=dtype, **kwargs)
    layer.build((None, 7, 48))
    rng = np.random.default_rng(1)
    for weight in layer.weights:
        weight.assign(rng.normal(1.0 if weight.name == "gamma" else 0.0, 0.3, size=weight.shape))
    return layer


def _rows(mean=0.0, std=1.0, seed=0):
    return np.random.default_rng(seed).normal(mean, std, size=(3, 7, 48)).astype("float32")


def test_the_switch_names_its_forms_and_keeps_keras_on_the_cpu(monkeypatch):
    """One pass on jax's GPU (the compiled programs' bytes, BENCHMARKS.md), Keras' form on
    the CPU (the measured one) and on the other backends."""
    monkeypatch.delenv(platform_forms.STATISTICS_ENV, raising=False)
    assert platform_forms.statistics_form() == "keras"
    with platform_forms.compiling_for("gpu"):
        assert platform_forms.statistics_form() == ("one_pass" if BACKEND == "jax" else "keras")
        monkeypatch.setenv(platform_forms.STATISTICS_ENV, "keras")
        assert platform_forms.statistics_form() == "keras"
    monkeypatch.setenv(platform_forms.STATISTICS_ENV, "welford")
    with pytest.raises(ValueError, match=r"\$KERAS_MONE_STATISTICS must be one of \['keras', 'one_pass', 'fused'\]"):
        platform_forms.statistics_form()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", ["float32", "mixed_bfloat16"])
def test_each_form_equals_keras_layer_normalization(monkeypatch, form, dtype):
    """float32: within 32 float32 ulps of Keras' layer (the same sums in another order);
    mixed_bfloat16: the float32 results differ by rounding, so the bf16 outputs by at
    most one bf16 ulp."""
    layer, x = _layer(dtype), _rows(mean=0.5)
    x = keras.ops.cast(x, layer.compute_dtype)
    expected = to_numpy(keras.ops.cast(layer(x), "float32"))
    monkeypatch.setenv(platform_forms.STATISTICS_ENV, form)
    if BACKEND == "jax" and form != "keras":  # the form's own ops, not the layer's call
        monkeypatch.setattr(layer, "call", lambda *args, **kwargs: pytest.fail("Keras' call ran"))
    got = normalize(layer, x)
    assert keras.backend.standardize_dtype(got.dtype) == layer.compute_dtype
    got = to_numpy(keras.ops.cast(got, "float32"))
    if dtype == "float32":
        assert_f32_close(got, expected)
    else:
        np.testing.assert_allclose(got, expected, rtol=2.0**-7, atol=2.0**-7)
    if BACKEND != "jax" or form == "keras":  # Keras' own layer: bit for bit
        assert np.array_equal(got, expected)


def test_one_pass_loses_what_its_docstring_says_on_rows_far_from_zero(monkeypatch):
    """``var = E[x^2] - E[x]^2`` loses about ``6e-8 * mean^2 / var`` of the variance in
    float32 (``layers.layer_norm``): rows with mean 10 and std 1 (``mean^2 / var = 100``)
    stay within 1e-4 of Keras' two-pass result relative to its largest value, and the
    variance is never negative (rows of one constant value give beta)."""
    layer, x = _layer(), _rows(mean=10.0, std=1.0)
    expected = to_numpy(layer(x))
    monkeypatch.setenv(platform_forms.STATISTICS_ENV, "one_pass")
    got = to_numpy(normalize(layer, x))
    np.testing.assert_allclose(got, expected, atol=1e-4 * float(np.abs(expected).max()))
    if BACKEND != "jax":  # Keras' layer ran (tensorflow's fused LayerNorm rounds a constant row its own way)
        return
    constant = np.full((1, 2, 48), 3.0, "float32")
    np.testing.assert_allclose(to_numpy(normalize(layer, constant)), np.broadcast_to(to_numpy(layer.beta), (1, 2, 48)),
                               atol=1e-5)


def test_layers_it_does_not_take_run_keras(monkeypatch):
    """RMS scaling, other axes, rematerialisation (``keras.RematScope``) or an unbuilt layer:
    ``layer(x)`` itself, Keras' call included."""
    monkeypatch.setenv(platform_forms.STATISTICS_ENV, "one_pass")
    x = _rows()
    with keras.RematScope(mode="full"):
        rematerialised = _layer()
    for layer in (_layer(rms_scaling=True), _layer(axis=[1, 2]), rematerialised):
        calls, call = [], layer.call
        monkeypatch.setattr(layer, "call", lambda *args, **kwargs: calls.append(1) or call(*args, **kwargs))
        assert np.array_equal(to_numpy(normalize(layer, x)), to_numpy(call(x))) and calls
    fresh = keras.layers.LayerNormalization()
    assert to_numpy(normalize(fresh, x)).shape == x.shape and fresh.built


@pytest.mark.parametrize("form", ["one_pass", "fused"])
def test_a_mone_model_is_the_same_function_in_every_form(monkeypatch, form):
    """A MoNE-ViT's outputs and gradients under each form: within float32 rounding of
    Keras' LayerNorms (the generic block path, which every backend runs here)."""
    from test_platform_forms import _assert_forms_agree, _outputs_and_gradients_by_form

    from keras_mone.layers import block as block_module

    monkeypatch.setattr(block_module, "packable", lambda *args, **kwargs: False)
    results = _outputs_and_gradients_by_form(monkeypatch, models.MoNEViTBackbone(**TINY, capacity=0.3), "STATISTICS")
    _assert_forms_agree(results, form, "keras")
