"""LayerNorm statistics forms (``$KERAS_MONE_STATISTICS``, ``layers.layer_norm``): each equals
Keras' ``LayerNormalization`` within float rounding, alone and inside a MoNE model, on
jax; every other backend runs Keras' layer whatever the switch says."""

import warnings

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
    with pytest.raises(ValueError, match=r"\$KERAS_MONE_STATISTICS must be one of \['keras', 'one_pass', 'fused', 'kernel'\]"):
        platform_forms.statistics_form()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("mean, std", [(0.5, 1.0), (0.0, 1e-3)])
def test_each_form_equals_keras_layer_normalization(monkeypatch, form, dtype, mean, std):
    """float32: within 32 float32 ulps of Keras' layer (the same sums in another order);
    mixed_bfloat16: the outputs within one bf16 ulp. Rows of std 1e-3 have a variance of
    epsilon's size (1e-6), so a form that dropped epsilon would fail."""
    layer, x = _layer(dtype), _rows(mean=mean, std=std)
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
    else:  # a bf16 ulp is 2^16 float32 ulps of the same value
        ulp = np.spacing(np.abs(expected).astype("float32")) * 2.0**16
        assert np.all(np.abs(got - expected) <= np.maximum(ulp, 1e-30)), np.max(np.abs(got - expected) / ulp)
    if BACKEND != "jax" or form == "keras":  # Keras' own layer: bit for bit
        assert np.array_equal(got, expected)


def _reduction_chain(form, layer, x, monkeypatch):
    """Whether a sum in ``normalize``'s jaxpr under ``form`` reads another sum's result."""
    import jax
    from jax.extend import core

    monkeypatch.setenv(platform_forms.STATISTICS_ENV, form)
    jaxpr = jax.make_jaxpr(lambda rows: normalize(layer, rows))(x).jaxpr
    depends = {}  # variable -> whether a reduction's result flows into it

    def walk(equations):
        chained = False
        for equation in equations:
            inputs = [depends.get(v, False) for v in equation.invars if not isinstance(v, core.Literal)]
            reduction = equation.primitive.name in ("reduce_sum", "reduce_max", "reduce_min")
            chained |= reduction and any(inputs)
            for inner in core.jaxprs_in_params(equation.params):
                chained |= walk(inner.eqns)
            for v in equation.outvars:
                depends[v] = reduction or any(inputs)
        return chained

    return walk(jaxpr.eqns)


@pytest.mark.skipif(BACKEND != "jax", reason="the forms are jax's; elsewhere normalize is layer(x)")
def test_one_pass_reads_the_rows_once_and_fused_twice(monkeypatch):
    """The forms are what they say: one pass has no reduction of another's result; Keras'
    and the fused form reduce the centred rows after the mean."""
    layer, x = _layer(), _rows()
    assert not _reduction_chain("one_pass", layer, x, monkeypatch)
    assert _reduction_chain("fused", layer, x, monkeypatch)
    assert _reduction_chain("keras", layer, x, monkeypatch)


def test_one_pass_loses_what_its_docstring_says_on_rows_far_from_zero(monkeypatch):
    """``var = E[x^2] - E[x]^2`` loses precision as ``mean^2 / var`` grows (``layers.layer_norm``):
    rows with mean 10 and std 1 (``mean^2 / var = 100``) stay within 1e-4 of Keras' two-pass
    result relative to its largest value. Rows of one large constant, whose raw one-pass
    variance rounds below zero (-0.5 for 1628.4078 over 48 features, XLA on the CPU), stay
    finite: the variance is clamped at 0."""
    layer, x = _layer(), _rows(mean=10.0, std=1.0)
    expected = to_numpy(layer(x))
    monkeypatch.setenv(platform_forms.STATISTICS_ENV, "one_pass")
    got = to_numpy(normalize(layer, x))
    np.testing.assert_allclose(got, expected, atol=1e-4 * float(np.abs(expected).max()))
    if BACKEND != "jax":  # Keras' layer ran
        return
    rows = np.float32(1628.4078) + np.zeros((1, 2, 48), "float32")
    ops = keras.ops
    raw = to_numpy(ops.mean(ops.square(rows), axis=-1) - ops.square(ops.mean(rows, axis=-1)))
    assert np.all(raw < 0)  # what the clamp is for
    assert np.all(np.isfinite(to_numpy(normalize(layer, rows))))


def test_layers_it_does_not_take_run_keras(monkeypatch):
    """RMS scaling, other axes, rematerialisation (``keras.RematScope``) or an unbuilt layer:
    ``layer(x)`` itself, Keras' call included."""
    monkeypatch.setenv(platform_forms.STATISTICS_ENV, "one_pass")
    x = _rows()
    with keras.RematScope(mode="full"):
        rematerialised = _layer()
    with warnings.catch_warnings():  # Keras 3.15 deprecates rms_scaling; normalize must still hand it back
        warnings.filterwarnings("ignore", message=".*rms_scaling=True", category=UserWarning)
        for layer in (_layer(rms_scaling=True), _layer(axis=[1, 2]), rematerialised):
            calls, call = [], layer.call
            monkeypatch.setattr(layer, "call", lambda *args, **kwargs: calls.append(1) or call(*args, **kwargs))
            assert np.array_equal(to_numpy(normalize(layer, x)), to_numpy(call(x))) and calls
    fresh = keras.layers.LayerNormalization()
    assert to_numpy(normalize(fresh, x)).shape == x.shape and fresh.built

    class Subclass(keras.layers.LayerNormalization):
        def call(self, inputs):
            return super().call(inputs) * 2.0

    custom = Subclass(epsilon=1e-6)
    custom.build((None, 7, 48))
    assert np.array_equal(to_numpy(normalize(custom, x)), to_numpy(custom(x)))
    inputs = keras.Input((7, 48))  # symbolic: Keras' call, so that a functional model tracks the weights
    assert len(keras.Model(inputs, normalize(_layer(), inputs)).weights) == 2


@pytest.mark.parametrize("form", ["one_pass", "fused", "kernel"])
def test_a_mone_model_is_the_same_function_in_every_form(monkeypatch, form):
    """A MoNE-ViT's outputs and gradients under each form: within float32 rounding of
    Keras' LayerNorms (the generic block path, which every backend runs here)."""
    from test_platform_forms import _assert_forms_agree, _outputs_and_gradients_by_form

    from keras_mone.layers import block as block_module

    from keras_mone.layers import layer_norm

    monkeypatch.setattr(block_module, "packable", lambda *args, **kwargs: False)
    taken, plain = [], layer_norm._plain
    monkeypatch.setattr(layer_norm, "_plain", lambda *args: taken.append(plain(*args)) or taken[-1])
    results = _outputs_and_gradients_by_form(monkeypatch, models.MoNEViTBackbone(**TINY, capacity=0.3), "STATISTICS")
    _assert_forms_agree(results, form, "keras")
    # the blocks' LayerNorms went through normalize, which computed them itself on jax
    assert taken and any(taken) == (BACKEND == "jax")


@pytest.mark.skipif(BACKEND != "jax", reason="the forms are jax's")
def test_the_rows_benchmark_measures_a_shipped_preset_and_each_form(monkeypatch):
    """``bench/layer_norm_rows.py`` at a tiny size: a shipped preset's token rows, and each
    form's error against float64 on rows of mean 10 (one pass: under 1e-4, as documented)."""
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import layer_norm_rows

    text = layer_norm_rows.main(["--presets", "mone_vit_digits", "--images", "4", "--means", "10"])
    assert "| mone_vit_digits | " in text and "| 10 | 1e+02 | " in text
    assert layer_norm_rows.row_ratios("vit_digits", np.zeros((2, 32, 32, 3), "float32")).size > 0
    errors = layer_norm_rows.form_errors(10.0, rows=256)
    assert set(errors) == set(FORMS) and errors["keras"] < 1e-5 and errors["one_pass"] < 1e-4
