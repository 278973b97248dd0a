"""Preset registry (keras_mone.presets, zoo/vit.toml) and the ViT size table."""

import re

import pytest

from keras_mone import presets
from keras_mone.bench.models import _unbuilt_layers
from keras_mone.presets import registry
from keras_mone.models import VIT_SIZES, ImageClassifier, MoNEViTBackbone, ViTBackbone, decode_variant
from keras_mone.methods.registry import architectures

# Published parameter counts (timm / the ViT and DeiT papers), 1000 classes, class token.
PUBLISHED = {"Ti": 5.72e6, "S": 22.05e6, "B": 86.57e6, "L": 304.33e6}


def expected_params(size, patch=16, image=224, num_classes=1000, class_token=True, mone=False, num_experts=4):
    """Parameter count of a pre-LN ViT (big_vision layout) written out term by term."""
    s = VIT_SIZES[size]
    d, depth, mlp = s["hidden_dim"], s["depth"], s["mlp_dim"]
    tokens = (image // patch) ** 2 + int(class_token)
    embed = patch * patch * 3 * d + d + tokens * d + d * int(class_token)
    block = 2 * (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * mlp + mlp) + (mlp * d + d)
    head = d * num_classes + num_classes
    total = embed + depth * block + 2 * d + head
    if mone:  # one router (D x E + E) at block 0 and an alpha in every block from it on
        total += d * num_experts + num_experts + depth
    return total


def test_expected_params_formula_matches_published_counts():
    # sanity of the formula itself: ViT-Ti/16 in timm has exactly 5,717,416 parameters
    assert expected_params("Ti") == 5_717_416
    for size, published in PUBLISHED.items():
        assert abs(expected_params(size) - published) / published < 0.005, size


def test_list_and_get():
    names = presets.list_presets()
    assert names == sorted(names)
    assert {"vit_ti16", "vit_s16", "vit_b16", "vit_l16", "mone_vit_ti16", "mone_vit_s16",
            "mone_vit_b16", "mone_vit_l16"} <= set(names)
    spec = presets.get_preset("mone_vit_b16")
    assert spec["architecture"] == "mone_vit" and spec["variant"] == "B/16" and spec["capacity"] == 0.5
    spec["capacity"] = 0.1  # a copy: the registry is not modified
    assert presets.get_preset("mone_vit_b16")["capacity"] == 0.5


@pytest.mark.parametrize("name", presets.list_presets())
def test_every_preset_resolves(name):
    # Cheap for every preset: the spec names a known architecture and variant,
    # and the parameter count in its description matches the size table.
    spec = presets.get_preset(name)
    assert spec["architecture"] in presets.ARCHITECTURES
    config = architectures()[spec["architecture"]].decode_variant(spec["variant"])
    size = spec["variant"].split("/")[0]
    if "digits" not in name:  # the zoo's full-size models all use 16x16 patches
        assert config["patch_size"] == 16
    match = re.search(r"([\d.]+)M parameters", spec["description"])
    vit = issubclass(presets.ARCHITECTURES[spec["architecture"]], ViTBackbone)  # (Mixers: test_mixer_models)
    if match and vit:  # dense descriptions quote the GAP model (no class token), rounded to 0.1M
        described = float(match.group(1)) * 1e6
        assert abs(expected_params(size, class_token=False) - described) / described < 0.005
    # Constructing (not building) the backbone validates every argument cheaply.
    backbone_cls = presets.ARCHITECTURES[spec["architecture"]]
    meta = registry.META_KEYS + ("num_classes", "pooling")
    arguments = {k: v for k, v in spec.items() if k not in meta}
    backbone_cls(**{**config, **arguments})


def build_and_count(name):
    model = presets.from_preset(name, load_weights=False, use_class_token=True)
    assert isinstance(model, ImageClassifier) and model.built and _unbuilt_layers(model) == []
    return model


@pytest.mark.parametrize("name", [n for n in presets.list_presets() if "digits" in n])
def test_preset_models_are_built_through_every_layer(name):
    # Keras' predict / predict_on_batch on jax run one eager, op-by-op forward
    # pass whenever any layer reports itself unbuilt (stateless DropPath did:
    # ~370 single-op compilations and ~500 MB of RSS for MoNE-ViT-B/16).
    assert _unbuilt_layers(presets.from_preset(name, load_weights=False)) == []


@pytest.mark.parametrize("name, size", [("vit_ti16", "Ti"), ("vit_s16", "S")])
def test_dense_parameter_counts(name, size):
    model = build_and_count(name)
    assert isinstance(model.backbone, ViTBackbone) and not isinstance(model.backbone, MoNEViTBackbone)
    count = model.count_params()
    assert abs(count - PUBLISHED[size]) / PUBLISHED[size] < 0.005
    assert count == expected_params(size)


@pytest.mark.parametrize("name, size", [("mone_vit_ti16", "Ti"), ("mone_vit_s16", "S")])
def test_mone_parameter_counts(name, size):
    # MoNE adds no expert parameters (the experts are nested slices); only the
    # router (D x 4 + 4) and one alpha per routed block.
    model = build_and_count(name)
    assert isinstance(model.backbone, MoNEViTBackbone)
    assert model.capacity == 0.5
    count = model.count_params()
    assert count == expected_params(size, mone=True)
    assert abs(count - PUBLISHED[size]) / PUBLISHED[size] < 0.005


@pytest.mark.large
@pytest.mark.parametrize("name, size, mone", [
    ("vit_b16", "B", False), ("vit_l16", "L", False), ("mone_vit_b16", "B", True), ("mone_vit_l16", "L", True),
])
def test_large_parameter_counts(name, size, mone):
    count = build_and_count(name).count_params()
    assert count == expected_params(size, mone=mone)
    assert abs(count - PUBLISHED[size]) / PUBLISHED[size] < 0.005


def test_overrides_and_merge_order():
    model = presets.from_preset(
        "mone_vit_ti16", load_weights=False, capacity=0.3, image_size=32, num_classes=10,
        depth=2, head_bias_init=-6.9,
    )
    assert model.name == "mone_vit_ti16"
    assert model.capacity == 0.3  # caller beats preset (0.5)
    assert model.backbone.hidden_dim == 192 and model.backbone.depth == 2  # caller beats size table
    assert model.backbone.image_size == [32, 32] and model.num_classes == 10
    assert model.head_bias_init == -6.9


def test_name_override():
    # registry.py reads a "name" override (for the classifier, not the backbone),
    # but from_preset's first parameter is also called `name`, so it cannot be passed.
    model = presets.from_preset("vit_ti16", load_weights=False, image_size=32, depth=1, name="my_model")
    assert model.name == "my_model"


def test_unknown_preset():
    with pytest.raises(ValueError, match="Unknown preset 'nope'.*vit_ti16"):
        presets.from_preset("nope")
    with pytest.raises(ValueError, match="Unknown preset"):
        presets.get_preset("nope")


def test_load_weights_without_published_weights():
    with pytest.raises(ValueError, match="no published weights.*load_weights=False"):
        presets.from_preset("vivit_fe_b16", load_weights=True)


def test_dense_vit_presets_default_to_the_augreg_checkpoint(monkeypatch):
    # No network in tests: the download is intercepted, its URL checked.
    asked = []

    def offline(url, sha256=None, cache_subdir=None, force_download=False):
        asked.append(url)
        raise OSError(f"Downloading {url} failed: offline")

    monkeypatch.setattr("keras_mone.presets.tags.download", offline)
    with pytest.raises(OSError, match="offline"):
        presets.from_preset("vit_ti16")
    assert asked == [
        "https://storage.googleapis.com/vit_models/augreg/Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0"
        "--imagenet2012-steps_20k-lr_0.03-res_224.npz"
    ]
    assert set(presets.weights_tags("mone_vit_ti16")) == {"augreg_in21k_ft_in1k", "augreg_in21k"}
    assert set(presets.weights_tags("vit_b16")) == {"augreg_in21k_ft_in1k", "augreg_in21k", "keras_hub_imagenet"}


def test_unknown_override_key():
    with pytest.raises(ValueError, match=r"Unknown argument\(s\) \['bogus'\].*Allowed"):
        presets.from_preset("vit_ti16", load_weights=False, bogus=1)
    # capacity is a MoNE argument: a dense preset rejects it by name
    with pytest.raises(ValueError, match=r"\['capacity'\]"):
        presets.from_preset("vit_ti16", load_weights=False, capacity=0.5)


def test_decode_variant():
    assert decode_variant("B/16") == dict(VIT_SIZES["B"], patch_size=16)
    assert decode_variant("Ti/8")["patch_size"] == 8
    for bad in ("X/16", "B", "B/sixteen", None):
        with pytest.raises(ValueError, match="variant"):
            decode_variant(bad)
