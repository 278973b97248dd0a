"""MLP-Mixer checkpoints (vision_transformer ``.npz``, timm) into ``MixerBackbone`` models (issue 26 item 2).

Nothing reaches the internet: each test writes a synthetic checkpoint with the
source's key names and shapes (``vit_jax/models_mixer.py``, timm
``mlp_mixer.py``) and random values, and compares the converted model with a
float64 numpy Mixer that reads the checkpoint arrays in the source's own
layout (flax kernels (in, out), torch weights (out, in), conv (out, in, kh,
kw)), so no mapping of the converter is reused by the reference.
"""

import math
import re
import warnings

import numpy as np
import pytest

from conftest import to_numpy
from keras_mone import convert, models, presets
from keras_mone.methods.mixer import checkpoints as mixer
from keras_mone.methods.mixer.method import SPARSE_MLP_TINY
from numpy_reference import gelu, layer_norm
from test_convert import write_safetensors

SIZE, P, C, S, DS, DC, DEPTH, CLASSES = 16, 4, 8, 16, 6, 12, 2, 5  # S = (SIZE / P)^2 tokens
TOLERANCE = 1e-5  # float32 round-off is ~1e-6; the other GELU form moves these logits by 1e-4 to 3e-4


def tanh_gelu(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def flax_arrays(seed=0):
    """A vision_transformer Mixer ``.npz``'s arrays (flax names and (in, out) kernels)."""
    rng = np.random.default_rng(seed)
    r = lambda *shape, scale=0.6: rng.normal(0, scale, shape).astype("float32")  # noqa: E731
    arrays = {"stem/kernel": r(P, P, 3, C, scale=0.1), "stem/bias": r(C),
              "pre_head_layer_norm/scale": 1 + r(C), "pre_head_layer_norm/bias": r(C),
              "head/kernel": r(C, CLASSES), "head/bias": r(CLASSES)}
    for i in range(DEPTH):
        b = f"MixerBlock_{i}/"
        for norm in ("LayerNorm_0", "LayerNorm_1"):
            arrays[b + norm + "/scale"], arrays[b + norm + "/bias"] = 1 + r(C), r(C)
        for mlp, width, hidden in (("token_mixing", S, DS), ("channel_mixing", C, DC)):
            arrays[f"{b}{mlp}/Dense_0/kernel"], arrays[f"{b}{mlp}/Dense_0/bias"] = r(width, hidden), r(hidden)
            arrays[f"{b}{mlp}/Dense_1/kernel"], arrays[f"{b}{mlp}/Dense_1/bias"] = r(hidden, width), r(width)
    return arrays


def timm_arrays(seed=1):
    """A timm ``MlpMixer`` state dict (torch (out, in) weights, conv (out, in, kh, kw))."""
    rng = np.random.default_rng(seed)
    r = lambda *shape, scale=0.6: rng.normal(0, scale, shape).astype("float32")  # noqa: E731
    arrays = {"stem.proj.weight": r(C, 3, P, P, scale=0.1), "stem.proj.bias": r(C),
              "norm.weight": 1 + r(C), "norm.bias": r(C), "head.weight": r(CLASSES, C), "head.bias": r(CLASSES)}
    for i in range(DEPTH):
        b = f"blocks.{i}."
        for norm in ("norm1", "norm2"):
            arrays[b + norm + ".weight"], arrays[b + norm + ".bias"] = 1 + r(C), r(C)
        for mlp, width, hidden in (("mlp_tokens", S, DS), ("mlp_channels", C, DC)):
            arrays[f"{b}{mlp}.fc1.weight"], arrays[f"{b}{mlp}.fc1.bias"] = r(hidden, width), r(hidden)
            arrays[f"{b}{mlp}.fc2.weight"], arrays[f"{b}{mlp}.fc2.bias"] = r(width, hidden), r(width)
    return arrays


def grid_patches(x, channels_first):
    """(B, H, W, c) -> (B, tokens, p*p*c), each patch flattened (kh, kw, c) or, torch's, (c, kh, kw)."""
    n, g = x.shape[0], SIZE // P
    x = x.reshape(n, g, P, g, P, 3)
    x = x.transpose(0, 1, 3, 5, 2, 4) if channels_first else x.transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(n, g * g, -1)


def flax_mixer(a, x, act, pool=True):
    """The flax Mixer on checkpoint arrays ``a`` (dense: ``x @ kernel + bias``)."""
    dense = lambda h, name: h @ a[name + "/kernel"].astype(np.float64) + a[name + "/bias"]  # noqa: E731
    ln = lambda h, name: layer_norm(h, a[name + "/scale"], a[name + "/bias"])  # noqa: E731
    h = grid_patches(x.astype(np.float64), False) @ a["stem/kernel"].reshape(-1, C) + a["stem/bias"]
    for i in range(DEPTH):
        b = f"MixerBlock_{i}/"
        t = ln(h, b + "LayerNorm_0").transpose(0, 2, 1)  # (B, C, S): token mixing along the patches
        h = h + dense(act(dense(t, b + "token_mixing/Dense_0")), b + "token_mixing/Dense_1").transpose(0, 2, 1)
        h = h + dense(act(dense(ln(h, b + "LayerNorm_1"), b + "channel_mixing/Dense_0")), b + "channel_mixing/Dense_1")
    h = ln(h, "pre_head_layer_norm")
    return dense(h.mean(axis=1), "head") if pool else h


def timm_mixer(a, x, act, pool=True):
    """timm's Mixer on state dict ``a`` (Linear: ``x @ weight.T + bias``)."""
    linear = lambda h, name: h @ a[name + ".weight"].T.astype(np.float64) + a[name + ".bias"]  # noqa: E731
    ln = lambda h, name: layer_norm(h, a[name + ".weight"], a[name + ".bias"])  # noqa: E731
    h = grid_patches(x.astype(np.float64), True) @ a["stem.proj.weight"].reshape(C, -1).T + a["stem.proj.bias"]
    for i in range(DEPTH):
        b = f"blocks.{i}."
        t = ln(h, b + "norm1").transpose(0, 2, 1)
        h = h + linear(act(linear(t, b + "mlp_tokens.fc1")), b + "mlp_tokens.fc2").transpose(0, 2, 1)
        h = h + linear(act(linear(ln(h, b + "norm2"), b + "mlp_channels.fc1")), b + "mlp_channels.fc2")
    h = ln(h, "norm")
    return linear(h.mean(axis=1), "head") if pool else h


FORMATS = {  # format: (arrays, write, reference, GELU of the source)
    "vision_transformer": (flax_arrays, lambda tmp, a: _npz(tmp, a), flax_mixer, True),
    "timm": (timm_arrays, lambda tmp, a: _safetensors(tmp, a), timm_mixer, False),
}


def _npz(tmp, arrays):
    np.savez(tmp / "mixer.npz", **arrays)
    return str(tmp / "mixer.npz")


def _safetensors(tmp, arrays):
    write_safetensors(tmp / "model.safetensors", arrays)
    return str(tmp / "model.safetensors")


def backbone(gelu_approximate=False, **overrides):
    config = dict(image_size=SIZE, patch_size=P, hidden_dim=C, depth=DEPTH, token_mlp_dim=DS, channel_mlp_dim=DC)
    return models.MixerBackbone(**{**config, **overrides}, gelu_approximate=gelu_approximate)


def classifier(gelu_approximate=False, num_classes=CLASSES, **overrides):
    model = models.ImageClassifier(backbone(gelu_approximate, **overrides), num_classes=num_classes)
    model.build()
    return model


def images(batch=2):
    return np.random.default_rng(7).standard_normal((batch, SIZE, SIZE, 3)).astype("float32")


def load(model, path, format, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = convert.load_checkpoint(model, path, format, **kwargs)
    return report, [str(w.message) for w in caught if "GELU" in str(w.message)]


@pytest.mark.parametrize("format", sorted(FORMATS))
@pytest.mark.parametrize("approximate", [True, False])
def test_checkpoint_computes_the_source_mixer(format, approximate, tmp_path):
    # Rules out: kernels not transposed (timm), the conv patch flattened in the wrong order, token mixing
    # applied on channels (or without the transposes), LayerNorm scale / bias swapped, the wrong final norm
    # or head, and `gelu_approximate` ignored: each GELU form must match the reference with that form.
    make, write, reference, source_gelu = FORMATS[format]
    arrays = make()
    model = classifier(gelu_approximate=approximate)
    report, gelu_warnings = load(model, write(tmp_path, arrays), format)
    x = images()
    expected = reference(arrays, x, tanh_gelu if approximate else gelu)
    np.testing.assert_allclose(to_numpy(model(x)), expected, atol=TOLERANCE, rtol=0)
    other = reference(arrays, x, gelu if approximate else tanh_gelu)
    assert np.max(np.abs(expected - other)) > 5 * TOLERANCE  # the two forms are told apart
    assert report["gelu_approximate"] is source_gelu and report["unused"] == {}
    assert "head/kernel" in report["loaded"] and not [p for p in report["kept"] if "backbone" in p]
    assert bool(gelu_warnings) is (approximate != source_gelu)  # warned only for the other GELU


@pytest.mark.parametrize("format", sorted(FORMATS))
def test_backbone_strict_refuses_the_head_and_loose_loads_the_rest(format, tmp_path):
    # Rules out silently dropping the checkpoint's head when the model is a bare backbone, and a loose
    # load that skips more than the head (its tokens must equal the reference's final-LayerNorm tokens).
    make, write, reference, source_gelu = FORMATS[format]
    arrays, model = make(), backbone(source_gelu)
    model.build()
    path = write(tmp_path, arrays)
    before = [to_numpy(v) for v in model.weights]
    head_key = "head/kernel" if format == "vision_transformer" else "head.weight"
    with pytest.raises(ValueError, match=f"(?s){head_key!r}.*no head.*strict=False"):
        load(model, path, format)
    assert all(np.array_equal(a, to_numpy(v)) for a, v in zip(before, model.weights))  # nothing written
    report, _ = load(model, path, format, strict=False)
    assert head_key in report["unused"] and len(report["unused"]) == 2
    expected = reference(arrays, images(), tanh_gelu if source_gelu else gelu, pool=False)
    np.testing.assert_allclose(to_numpy(model(images())), expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("format", sorted(FORMATS))
def test_extra_key_is_named_and_loose_load_lists_it(format, tmp_path):
    # Rules out ignoring checkpoint keys the model has no part for (e.g. a ResMLP layer scale in a timm file).
    make, write, reference, source_gelu = FORMATS[format]
    extra = "MixerBlock_0/extra/kernel" if format == "vision_transformer" else "blocks.0.ls1"
    arrays = {**make(), extra: np.ones(C, "float32")}
    model = classifier(source_gelu)
    path = write(tmp_path, arrays)
    with pytest.raises(ValueError, match=f"1 key.*(?s:.*){extra!r}"):
        load(model, path, format)
    report, _ = load(model, path, format, strict=False)
    assert list(report["unused"]) == [extra]
    del arrays[extra]
    expected = reference(arrays, images(), tanh_gelu if source_gelu else gelu)
    np.testing.assert_allclose(to_numpy(model(images())), expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("format, key", [("vision_transformer", "MixerBlock_1/channel_mixing/Dense_1/bias"),
                                         ("timm", "blocks.1.mlp_tokens.fc2.weight")])
def test_missing_key_is_named(format, key, tmp_path):
    # Rules out leaving a weight at its initial value when the checkpoint lacks it.
    make, write, _, source_gelu = FORMATS[format]
    arrays = make()
    del arrays[key]
    with pytest.raises(ValueError, match=f"checkpoint .*has no {key!r}"):
        load(classifier(source_gelu), write(tmp_path, arrays), format)


@pytest.mark.parametrize("format, key", [("vision_transformer", "MixerBlock_0/token_mixing/Dense_0/kernel"),
                                         ("timm", "blocks.0.mlp_tokens.fc1.weight")])
def test_wrong_shape_names_the_key_and_both_shapes(format, key, tmp_path):
    # Rules out loading into a model of another token-MLP width (or a transposed kernel) without a word,
    # and an error that names the model's path but not the checkpoint key.
    make, write, _, source_gelu = FORMATS[format]
    model = classifier(source_gelu, token_mlp_dim=DS + 4)
    before = [to_numpy(v) for v in model.weights]
    message = re.escape(f"{key!r} ({S}, {DS}) -> model 'backbone/block_0/token_mixing/dense_0/kernel' ({S}, {DS + 4})")
    with pytest.raises(ValueError, match=f"nothing was loaded(?s:.*){message}(?s:.*)token_mlp_dim"):
        load(model, write(tmp_path, make()), format)
    assert all(np.array_equal(a, to_numpy(v)) for a, v in zip(before, model.weights))


def test_other_class_count_and_depth(tmp_path):
    # Rules out loading a head of another class count (strict names num_classes; loose keeps the model's
    # head) and loading a checkpoint of another depth into the first blocks.
    path = _npz(tmp_path, flax_arrays())
    with pytest.raises(ValueError, match="head has 5 classes, the model 3: build it with num_classes=5"):
        load(classifier(True, num_classes=3), path, "vision_transformer")
    model = classifier(True, num_classes=3)
    report, _ = load(model, path, "vision_transformer", strict=False)
    assert set(report["unused"]) == {"head/kernel", "head/bias"} and "head/kernel" in report["kept"]
    with pytest.raises(ValueError, match="has 2 blocks but the model has `depth`=3"):
        load(classifier(True, depth=3), path, "vision_transformer")


def test_pth_file_reads_like_safetensors(tmp_path):
    # Rules out the .pth reader taking another path than safetensors (e.g. not reaching the Mixer converter).
    torch = pytest.importorskip("torch")
    arrays = timm_arrays()
    torch.save({k: torch.from_numpy(v) for k, v in arrays.items()}, tmp_path / "mixer.pth")
    model = classifier()
    load(model, str(tmp_path / "mixer.pth"), "timm")
    np.testing.assert_allclose(to_numpy(model(images())), timm_mixer(arrays, images(), gelu), atol=TOLERANCE, rtol=0)


def test_bad_model_format_or_file(tmp_path):
    # Rules out a Sparse-MLP or a ViT checkpoint being half-loaded, and an unknown format passing.
    path = _npz(tmp_path, flax_arrays())
    sparse = models.SparseMLPBackbone(**SPARSE_MLP_TINY)
    with pytest.raises(TypeError, match="SparseMLPBackbone"):
        load(sparse, path, "vision_transformer")
    with pytest.raises(ValueError, match=r"formats \('vision_transformer', 'timm'\), got `format`='big_vision'"):
        load(classifier(), path, "big_vision")
    vit_file = _npz(tmp_path, {"embedding/kernel": np.zeros((P, P, 3, C), "float32")})
    with pytest.raises(ValueError, match="not a 'vision_transformer' MLP-Mixer checkpoint.*'stem/kernel'"):
        load(classifier(), vit_file, "vision_transformer")
    with pytest.raises(FileNotFoundError, match="nowhere.npz"):
        load(classifier(), str(tmp_path / "nowhere.npz"), "vision_transformer")
    with pytest.raises(TypeError, match="MixerBackbone"):
        mixer.check_mixer_model(models.ViTBackbone(image_size=SIZE, patch_size=P, hidden_dim=C, depth=1,
                                                   num_heads=2, mlp_dim=DC))


def test_weights_tag_converts_through_the_preset(monkeypatch, tmp_path):
    # Rules out tags that never reach the Mixer converter (or build the exact GELU for a flax file):
    # the preset's default tag is the vision_transformer ImageNet-1k file, converted into a tanh-GELU model.
    asked = []
    arrays = flax_arrays()
    path = _npz(tmp_path, arrays)

    def offline(url, sha256=None, cache_subdir=None, force_download=False):
        asked.append(url)
        return path

    monkeypatch.setattr("keras_mone.presets.tags.download", offline)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    model = presets.from_preset("mixer_b16", image_size=SIZE, patch_size=P, hidden_dim=C, depth=DEPTH,
                                token_mlp_dim=DS, channel_mlp_dim=DC, num_classes=CLASSES)
    assert asked == ["https://storage.googleapis.com/mixer_models/imagenet1k/Mixer-B_16.npz"]
    assert model.backbone.gelu_approximate is True
    expected = flax_mixer(arrays, images(), tanh_gelu)
    np.testing.assert_allclose(to_numpy(model(images())), expected, atol=TOLERANCE, rtol=0)
    assert set(presets.weights_tags("mixer_l16")) == {"imagenet1k", "imagenet21k", "timm_goog_in21k_ft_in1k",
                                                      "timm_goog_in21k"}
