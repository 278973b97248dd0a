"""Per-platform forms (issue 40 item 2): fused attention on accelerators, the CPU's measured form
on jax and tensorflow's CPU, both equal within float rounding on every backend."""

import numpy as np
import pytest
from conftest import BACKEND, TINY, assert_f32_close, images, randomize_weights, to_numpy

from keras_mone import models
from keras_mone.layers import platform_forms
from keras_mone.layers.attention import multi_head_attention


def test_the_cpu_keeps_its_measured_form(monkeypatch):
    monkeypatch.delenv(platform_forms.ATTENTION_ENV, raising=False)
    assert platform_forms.accelerator() == "cpu"  # CI and this machine
    assert platform_forms.attention_form() == ("fused" if BACKEND == "torch" else "explicit")
    for form in platform_forms.ATTENTION_FORMS:
        monkeypatch.setenv(platform_forms.ATTENTION_ENV, form)
        assert platform_forms.attention_form() == form


def test_a_bad_override_names_the_variable(monkeypatch):
    monkeypatch.setenv(platform_forms.ATTENTION_ENV, "flash")
    with pytest.raises(ValueError, match=r"\$KERAS_MONE_ATTENTION must be one of \['fused', 'explicit'\]"):
        platform_forms.attention_form()


def _attention(monkeypatch, form, qkv):
    monkeypatch.setenv(platform_forms.ATTENTION_ENV, form)
    return to_numpy(multi_head_attention(qkv))


@pytest.mark.parametrize("groups", [1, 3])
def test_fused_and_explicit_attention_agree(monkeypatch, groups):
    rng = np.random.default_rng(0)
    sizes = [5, 7, 4][:groups]
    qkv = [rng.normal(size=(2, n, 3, 4, 8)).astype("float32") for n in sizes]
    qkv = qkv[0] if groups == 1 else qkv
    fused, explicit = _attention(monkeypatch, "fused", qkv), _attention(monkeypatch, "explicit", qkv)
    assert fused.shape == explicit.shape == (2, sum(sizes), 4, 8)
    # Both are softmax(q k^T / sqrt(8)) v in float32; they differ in the order of
    # the reductions only (a few ulps of values of order 1).
    assert_f32_close(fused, explicit, ulps=64)


def test_a_mone_model_gives_the_same_outputs_in_both_forms(monkeypatch):
    model = models.MoNEViTBackbone(**TINY, capacity=0.5)
    model.build((None, 32, 32, 3))
    randomize_weights(model, seed=3)
    x = images()
    monkeypatch.setenv(platform_forms.ATTENTION_ENV, "explicit")
    explicit = to_numpy(model(x))
    monkeypatch.setenv(platform_forms.ATTENTION_ENV, "fused")
    fused = to_numpy(model(x))
    assert_f32_close(fused, explicit)


def test_received_attention_keeps_the_explicit_form(monkeypatch):
    # A-MoD's score needs the attention weights, which a fused kernel does not return.
    qkv = np.random.default_rng(1).normal(size=(2, 6, 3, 4, 8)).astype("float32")
    monkeypatch.setenv(platform_forms.ATTENTION_ENV, "fused")
    attended, received = multi_head_attention(qkv, return_received_attention=True)
    np.testing.assert_allclose(to_numpy(received).sum(-1), 1.0, rtol=1e-5)  # each query row's weights sum to 1
    assert_f32_close(to_numpy(attended), _attention(monkeypatch, "explicit", qkv))
