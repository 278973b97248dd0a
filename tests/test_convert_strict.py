"""Converters never load a checkpoint partially (issue 24 items 3 and 12, issue 29 item 5).

Every test writes a synthetic checkpoint (``test_convert``'s writers) with
the variant under test: strict loading names every key the model would not
use and writes nothing; ``strict=False`` loads what fits and reports the
rest; the variants the model can represent (pre-logits, GAP files without
``cls``, timm ``no_embed_class`` and layer scale, flax's tanh GELU) compute what the
reference computes on the same parameters.
"""

import math
import warnings

import keras
import numpy as np
import pytest

import numpy_reference as ref
from conftest import images, to_numpy
from keras_mone import convert, models
from test_convert import (
    CLASSES, DEPTH, TOLERANCE, D, H, M, P, _npz, _safetensors, expected_tokens, reference_params,
    to_npz_arrays, to_timm_state,
)

R = 16  # width of the representation (pre-logits) layer


def build(use_class_token=True, num_classes=CLASSES, backbone_only=False, video=False, **options):
    config = dict(image_size=32, patch_size=P, hidden_dim=D, depth=DEPTH, num_heads=H, mlp_dim=M,
                  use_class_token=use_class_token)
    if options.pop("gelu_approximate", False):
        config["gelu_approximate"] = True
    if video:
        backbone = models.ViViTBackbone(**dict(config, image_size=16), num_frames=2, tubelet_size=2, temporal_depth=1)
    else:
        backbone = models.ViTBackbone(**config)
    if backbone_only or video:
        backbone.build()
        return backbone
    model = models.ImageClassifier(backbone, num_classes=num_classes,
                                   pooling="token" if use_class_token else "gap", **options)
    model.build()
    return model


def quiet_load(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the GELU note, tested on its own
        return convert.load_checkpoint(*args, **kwargs)


def tanh_gelu(x):
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


# -- variants: (writer of the file, format, model options, unused keys, message) --
def _vt(params, tmp, **extra):
    return _npz(tmp, {**to_npz_arrays(params, "vision_transformer"), **extra})


def _bv(params, tmp, **extra):
    return _npz(tmp, {**to_npz_arrays(params, "big_vision"), **extra})


def _timm(params, tmp, drop=(), **extra):
    sd = {k: v for k, v in to_timm_state(params).items() if k not in drop}
    return _safetensors(tmp, {**sd, **extra})


ONES = np.ones(D, "float32")
UNUSED = {
    "map_head": (lambda p, t: _bv(p, t, **{"params/MAPHead_0/probe": ONES[None, None],
                                           "params/MAPHead_0/LayerNorm_0/scale": ONES}),
                 "big_vision", {}, {"params/MAPHead_0/probe", "params/MAPHead_0/LayerNorm_0/scale"}, "no MAP head"),
    "reg_token": (lambda p, t: _timm(p, t, reg_token=np.zeros((1, 4, D), "float32")),
                  "timm", {}, {"reg_token"}, "no register tokens"),
    "fc_norm_gap": (lambda p, t: _timm(p, t, drop=("norm.weight", "norm.bias", "cls_token"),
                                       **{"fc_norm.weight": ONES, "fc_norm.bias": 0 * ONES,
                                          "pos_embed": p["patch_embedding/position_embedding"][:, 1:]}),
                    "timm", dict(use_class_token=False), {"fc_norm.weight", "fc_norm.bias"}, "LayerNorm after pooling"),
    "fc_norm_beside_norm": (lambda p, t: _timm(p, t, **{"fc_norm.weight": ONES, "fc_norm.bias": 0 * ONES}),
                            "timm", {}, {"fc_norm.weight", "fc_norm.bias"}, "LayerNorm after pooling"),
    "pre_logits_without_representation": (
        lambda p, t: _vt(p, t, **{"pre_logits/kernel": np.ones((D, D), "float32"), "pre_logits/bias": ONES}),
        "vision_transformer", {}, {"pre_logits/kernel", "pre_logits/bias", "head/kernel", "head/bias"},
        f"representation_size={D}"),
    "class_token_into_gap": (lambda p, t: _timm(p, t), "timm", dict(use_class_token=False), {"cls_token"},
                             'use_class_token=True, pooling="token"'),
    "other_class_count": (lambda p, t: _timm(p, t), "timm", dict(num_classes=3), {"head.weight", "head.bias"},
                          f"num_classes={CLASSES}"),
    "head_into_backbone": (lambda p, t: _timm(p, t), "timm", dict(backbone_only=True), {"head.weight", "head.bias"},
                           "no head"),
    "unknown_key": (lambda p, t: _vt(p, t, **{"Transformer/extra/scale": ONES}), "vision_transformer", {},
                    {"Transformer/extra/scale"}, "unknown key"),
}


@pytest.mark.parametrize("variant", sorted(UNUSED))
def test_strict_names_every_unused_key_and_writes_nothing(variant, tmp_path):
    # Rules out ignoring keys silently (issue 24 item 3) and writing before refusing.
    write, format, options, unused, message = UNUSED[variant]
    params = reference_params()
    path = str(write(params, tmp_path))
    model = build(**options)
    before = model.get_weights()
    with pytest.raises(ValueError, match="strict=False") as error:
        quiet_load(model, path, format)
    assert message in str(error.value) and all(repr(key) in str(error.value) for key in unused)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    report = quiet_load(model, path, format, strict=False)
    assert set(report["unused"]) == unused
    assert any("block_1/mlp/fc2/kernel" in p for p in report["loaded"])


def test_checkpoint_without_unused_keys_reports_none(tmp_path):
    report = quiet_load(build(), str(_timm(reference_params(), tmp_path)), "timm")
    assert report["unused"] == {} and report["gelu_approximate"] is False


@pytest.mark.parametrize("source", ["vision_transformer", "big_vision", "timm"])
def test_pre_logits_load_into_the_representation_layer(source, tmp_path):
    # Rules out dropping pre_logits (tanh representation) or applying it without tanh.
    params = reference_params()
    rng = np.random.default_rng(1)
    kernel, bias = rng.normal(0, 0.3, (D, R)).astype("float32"), rng.normal(0, 0.3, R).astype("float32")
    head = rng.normal(0, 0.3, (R, CLASSES)).astype("float32")
    if source == "timm":
        path = _timm(params, tmp_path, **{"pre_logits.fc.weight": kernel.T, "pre_logits.fc.bias": bias,
                                          "head.weight": head.T})
    else:
        prefix = "params/" if source == "big_vision" else ""
        if source == "big_vision":
            params["patch_embedding/position_embedding"][:, 0] = 0.0
        writer = _bv if source == "big_vision" else _vt
        path = writer(params, tmp_path, **{f"{prefix}pre_logits/kernel": kernel, f"{prefix}pre_logits/bias": bias,
                                           f"{prefix}head/kernel": head})
    model = build(representation_size=R)
    report = quiet_load(model, str(path), source)
    assert report["unused"] == {} and "pre_logits/kernel" in report["loaded"]
    x = images()
    features = np.tanh(expected_tokens(params, x)[:, 0] @ kernel + bias)
    np.testing.assert_allclose(to_numpy(model(x)), features @ head + params["head/bias"], atol=TOLERANCE)


def test_vision_transformer_gap_file_without_cls(tmp_path):
    # Rules out refusing *-gap-norep files or reading their grid-only positions as class + grid.
    params = reference_params()
    arrays = to_npz_arrays(params, "vision_transformer")
    del arrays["cls"]
    arrays["Transformer/posembed_input/pos_embedding"] = params["patch_embedding/position_embedding"][:, 1:]
    model = build(use_class_token=False)
    report = quiet_load(model, str(_npz(tmp_path, arrays)), "vision_transformer")
    assert report["unused"] == {}
    x = images()
    expected = expected_tokens(params, x, use_class_token=False)
    assert np.max(np.abs(to_numpy(model.backbone(x)) - expected)) <= TOLERANCE
    np.testing.assert_allclose(to_numpy(model(x)), expected.mean(1) @ params["head/kernel"] + params["head/bias"],
                               atol=TOLERANCE)


def test_timm_no_embed_class(tmp_path):
    # Rules out "15 position embeddings do not form a square grid" and a shifted grid.
    params = reference_params()
    params["patch_embedding/position_embedding"][:, 0] = 0.0  # the class token has no position
    path = _timm(params, tmp_path, pos_embed=params["patch_embedding/position_embedding"][:, 1:])
    model = build()
    quiet_load(model, str(path), "timm")
    x = images()
    assert np.max(np.abs(to_numpy(model.backbone(x)) - expected_tokens(params, x))) <= TOLERANCE


def test_timm_layer_scale_is_applied(tmp_path):
    # Rules out ignoring ls1/ls2 (DeiT-III, DINOv2), swapping them, or scaling rows instead of columns.
    params = reference_params()
    rng = np.random.default_rng(2)
    gammas = {f"blocks.{i}.ls{j}.gamma": rng.uniform(0.1, 2.0, D).astype("float32") for i in range(DEPTH) for j in (1, 2)}
    path = _timm(params, tmp_path, **gammas)
    scaled = dict(params)
    for i in range(DEPTH):
        for j, layer in ((1, "attention/out"), (2, "mlp/fc2")):
            gamma = gammas[f"blocks.{i}.ls{j}.gamma"]
            scaled[f"block_{i}/{layer}/kernel"] = params[f"block_{i}/{layer}/kernel"] * gamma
            scaled[f"block_{i}/{layer}/bias"] = params[f"block_{i}/{layer}/bias"] * gamma
    model = build()
    assert quiet_load(model, str(path), "timm")["unused"] == {}
    x = images()
    expected = expected_tokens(scaled, x)
    assert np.max(np.abs(expected - expected_tokens(params, x))) > 100 * TOLERANCE
    assert np.max(np.abs(to_numpy(model.backbone(x)) - expected)) <= TOLERANCE


def test_gelu_approximate_computes_what_flax_computes(tmp_path, monkeypatch):
    # Rules out the option being ignored (exact GELU either way) and a silent mismatch.
    params = reference_params()
    for key in params:  # larger MLP inputs, where the two GELUs differ
        if key.endswith(("fc1/kernel", "fc2/kernel")):
            params[key] = params[key] * 4
    path = str(_vt(params, tmp_path))
    x = images()
    exact = expected_tokens(params, x)
    monkeypatch.setattr(ref, "gelu", tanh_gelu)
    approximate = expected_tokens(params, x)
    assert np.max(np.abs(exact - approximate)) > 2 * TOLERANCE  # the test can tell them apart
    model = build(gelu_approximate=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no GELU warning when the model matches
        report = convert.load_checkpoint(model, path, "vision_transformer")
    assert report["gelu_approximate"] is True
    assert np.max(np.abs(to_numpy(model.backbone(x)) - approximate)) <= TOLERANCE
    with pytest.warns(UserWarning, match="tanh-approximate GELU.*gelu_approximate=True"):
        convert.load_checkpoint(build(), path, "vision_transformer")


def test_new_options_round_trip_through_keras_files(tmp_path):
    model = build(gelu_approximate=True, representation_size=R)
    for variable in model.weights:
        variable.assign(np.random.default_rng(0).normal(0, 0.3, variable.shape).astype("float32"))
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert loaded.representation_size == R and loaded.backbone.blocks[0].mlp.gelu_approximate is True
    np.testing.assert_allclose(to_numpy(loaded(images())), to_numpy(model(images())), atol=1e-6)
    with pytest.raises(ValueError, match="`gelu_approximate` must be True or False"):
        models.ViTBackbone(gelu_approximate="yes")
    with pytest.raises(ValueError, match="`representation_size` must be an int"):
        models.ImageClassifier(models.ViTBackbone(**dict(image_size=32, patch_size=P, hidden_dim=D, depth=1,
                                                         num_heads=H, mlp_dim=M)), representation_size=0)


# -- item 12: errors that name the file, the block and what to do -------------
def _vt_blocks(params, tmp, rename=None, drop=None):
    arrays = to_npz_arrays(params, "vision_transformer")
    if drop:
        del arrays[drop]
    if rename:
        arrays = {k.replace(*rename): v for k, v in arrays.items()}
    return _npz(tmp, arrays)


ERRORS = {
    "npz_key_missing_in_block": (
        lambda p, t: _vt_blocks(p, t, drop="Transformer/encoderblock_1/MlpBlock_3/Dense_0/kernel"),
        "vision_transformer", r"checkpoint\.npz'.*block 1 .*has no 'MlpBlock_3/Dense_0/kernel'"),
    "npz_blocks_0_and_2": (lambda p, t: _vt_blocks(p, t, rename=("encoderblock_1/", "encoderblock_2/")),
                           "vision_transformer", r"checkpoint\.npz'.*numbered \[0, 2\].*\[1\] missing"),
    "timm_key_missing_in_block": (lambda p, t: _timm(p, t, drop=("blocks.1.mlp.fc1.weight",)),
                                  "timm", r"model\.safetensors'.*block 'blocks\.1' has no 'blocks\.1\.mlp\.fc1\.weight'"),
    "timm_blocks_0_and_2": (
        lambda p, t: _safetensors(t, {k.replace("blocks.1.", "blocks.2."): v for k, v in to_timm_state(p).items()}),
        "timm", r"model\.safetensors'.*numbered \[0, 2\].*\[1\] missing"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_damaged_blocks_are_named(case, tmp_path):
    write, format, message = ERRORS[case]
    with pytest.raises(ValueError, match=message):
        quiet_load(build(), str(write(reference_params(), tmp_path)), format)


def test_wrong_model_or_source_type(tmp_path):
    path = str(_timm(reference_params(), tmp_path))
    with pytest.raises(TypeError, match="vivit_from_image_backbone"):
        quiet_load(build(video=True), path, "timm")
    with pytest.raises(TypeError, match="format 'keras_hub' takes a keras-hub model object.*got dict"):
        quiet_load(build(), {"patch_embed.proj.weight": np.zeros(1)}, "keras_hub")
    with pytest.raises(TypeError, match="format 'timm' takes the path of a checkpoint file.*got dict"):
        quiet_load(build(), {"patch_embed.proj.weight": np.zeros(1)}, "timm")


def test_flax_weights_tags_build_the_tanh_gelu(monkeypatch):
    # Rules out presets converting AugReg checkpoints into an exact-GELU model (or keras-hub into a tanh one).
    from keras_mone.presets import registry

    for name, spec in registry._zoo().items():
        for tag, entry in spec.get("tags", {}).items():
            flax = entry["format"] in ("vision_transformer", "big_vision")
            assert entry.get("config", {}).get("gelu_approximate", False) is flax, (name, tag)
    monkeypatch.setattr(registry, "load_tagged_weights", lambda *args: None)  # no download
    monkeypatch.setattr(registry, "warn_untrained", lambda *args: None)
    model = registry.from_preset("vit_ti16", weights="augreg_in21k_ft_in1k", depth=1)
    assert model.backbone.blocks[0].mlp.gelu_approximate is True


def test_keras_hub_classifier_with_pre_logits():
    # Rules out dropping keras-hub's intermediate (pre_logits) layer or its head.
    keras_hub = pytest.importorskip("keras_hub")
    hub_backbone = keras_hub.models.ViTBackbone(image_shape=(32, 32, 3), patch_size=P, num_layers=DEPTH,
                                                num_heads=H, hidden_dim=D, mlp_dim=M)
    hub = keras_hub.models.ViTImageClassifier(hub_backbone, num_classes=CLASSES, intermediate_dim=R)
    rng = np.random.default_rng(4)
    for variable in hub.weights:
        variable.assign(rng.normal(0, 0.2, variable.shape).astype("float32"))
    model = build(representation_size=R)
    report = convert.load_checkpoint(model, hub, "keras_hub")
    assert report["unused"] == {} and "pre_logits/kernel" in report["loaded"] and "head/kernel" in report["loaded"]
    x = images()
    np.testing.assert_allclose(to_numpy(model(x)), to_numpy(hub(x)), atol=TOLERANCE)
