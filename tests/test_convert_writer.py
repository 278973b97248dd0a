"""``convert.write_checkpoint``: every format written, then read back by ``load_checkpoint`` (issue 43 item 4).

Each round trip writes a model with random weights and loads the file into
a fresh model of the same configuration (other random weights) with the
loader's strict check: every weight must come back bit for bit and every
output with it. The files' keys are compared with the layouts of
docs/presets.md, spelled out here key by key (not taken from the writer's
tables), and a few orientations are checked element for element.
"""

import json
import os
import re
import struct
import warnings

import numpy as np
import pytest

from conftest import TINY, TINY_VIDEO, images, randomize_weights, to_numpy
from keras_mone import convert, models, presets
from keras_mone.convert.big_vision import read_npz
from keras_mone.convert.timm import read_pth, read_safetensors
from keras_mone.convert.writer import FORMAT_GELU, VIT_FORMATS
from keras_mone.methods.mixer.checkpoints import FORMATS as MIXER_FORMATS
from keras_mone.methods.mixer.method import SPARSE_MLP_TINY
from keras_mone.models.weight_transfer import relative_weight_paths

D, H, M, P, DEPTH = TINY["hidden_dim"], TINY["num_heads"], TINY["mlp_dim"], TINY["patch_size"], TINY["depth"]
N, K, R = (TINY["image_size"] // P) ** 2, 5, 12  # patches, classes, representation width
MIXER = dict(image_size=16, patch_size=4, hidden_dim=8, depth=2, token_mlp_dim=6, channel_mlp_dim=12)
S = (MIXER["image_size"] // MIXER["patch_size"]) ** 2
FILES = {"vision_transformer": "model.npz", "big_vision": "model.npz", "timm": "model.safetensors",
         "timm_pth": "model.pth"}


def vit(class_token=False, representation_size=None, backbone_only=False, gelu_approximate=False, seed=1):
    backbone = models.ViTBackbone(**TINY, use_class_token=class_token, gelu_approximate=gelu_approximate)
    model = backbone if backbone_only else models.ImageClassifier(
        backbone, num_classes=K, pooling="token" if class_token else "gap", representation_size=representation_size)
    model.build()
    randomize_weights(model, seed=seed)
    return model


def mixer(backbone_only=False, gelu_approximate=False, seed=1):
    backbone = models.MixerBackbone(**MIXER, gelu_approximate=gelu_approximate)
    model = backbone if backbone_only else models.ImageClassifier(backbone, num_classes=K)
    model.build()
    randomize_weights(model, seed=seed)
    return model


def weights(model):
    return {path: to_numpy(v.value) for path, v in relative_weight_paths(model).items()}


def outputs(model, size=TINY["image_size"]):
    return to_numpy(model(images(size=size)))


def round_trip(model, fresh, path, format, source=None):
    """Writes ``model``, loads the file (or ``source``) into ``fresh`` strictly; the write report."""
    report = convert.write_checkpoint(model, path, format)
    loaded = convert.load_checkpoint(fresh, path if source is None else source(path), format)
    assert report["dropped"] == {} and loaded["unused"] == {}
    assert loaded["kept"] == {}, loaded["kept"]  # every weight of the model came from the file
    return report


def assert_same_model(model, fresh, size=TINY["image_size"], changed=()):
    expected, found = weights(model), weights(fresh)
    assert expected.keys() == found.keys()
    for path in set(expected) - set(changed):
        assert np.array_equal(expected[path], found[path]), path
    np.testing.assert_array_equal(outputs(fresh, size), outputs(model, size))


def file_arrays(path):
    """The file's ``{key: array}``, read as the loaders read it."""
    if path.endswith(".npz"):
        return read_npz(path)
    return read_pth(path) if path.endswith(".pth") else read_safetensors(path)


# -- the documented key layouts, key by key ------------------------------------
def vit_keys(format, class_token, head, pre_logits):
    """Every key of a ViT file in ``format``, as docs/presets.md tables them."""
    if format == "timm":
        keys = {"patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed", "norm.weight", "norm.bias"}
        keys |= {"cls_token"} if class_token else set()
        keys |= {"head.weight", "head.bias"} if head else set()
        keys |= {"pre_logits.fc.weight", "pre_logits.fc.bias"} if pre_logits else set()
        for i in range(DEPTH):
            keys |= {f"blocks.{i}.{m}.{w}" for m in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2")
                     for w in ("weight", "bias")}
        return keys
    vt = format == "vision_transformer"
    keys = {"embedding/kernel", "embedding/bias", "Transformer/encoder_norm/scale", "Transformer/encoder_norm/bias",
            "Transformer/posembed_input/pos_embedding" if vt else "pos_embedding"}
    keys |= {"cls"} if class_token else set()
    keys |= {"head/kernel", "head/bias"} if head else set()
    keys |= {"pre_logits/kernel", "pre_logits/bias"} if pre_logits else set()
    attention = "MultiHeadDotProductAttention_1" if vt else "MultiHeadDotProductAttention_0"
    mlp = "MlpBlock_3" if vt else "MlpBlock_0"
    for i in range(DEPTH):
        block = f"Transformer/encoderblock_{i}/"
        keys |= {f"{block}{norm}/{w}" for norm in ("LayerNorm_0", "LayerNorm_2" if vt else "LayerNorm_1")
                 for w in ("scale", "bias")}
        keys |= {f"{block}{attention}/{p}/{w}" for p in ("query", "key", "value", "out") for w in ("kernel", "bias")}
        keys |= {f"{block}{mlp}/Dense_{j}/{w}" for j in (0, 1) for w in ("kernel", "bias")}
    return keys if vt else {"params/" + key for key in keys}


def mixer_keys(format, head):
    if format == "timm":
        keys = {"stem.proj.weight", "stem.proj.bias", "norm.weight", "norm.bias"} | (
            {"head.weight", "head.bias"} if head else set())
        parts = ("norm1", "norm2", "mlp_tokens.fc1", "mlp_tokens.fc2", "mlp_channels.fc1", "mlp_channels.fc2")
        return keys | {f"blocks.{i}.{part}.{w}" for i in range(DEPTH) for part in parts for w in ("weight", "bias")}
    keys = {"stem/kernel", "stem/bias", "pre_head_layer_norm/scale", "pre_head_layer_norm/bias"} | (
        {"head/kernel", "head/bias"} if head else set())
    for i in range(DEPTH):
        keys |= {f"MixerBlock_{i}/LayerNorm_{j}/{w}" for j in (0, 1) for w in ("scale", "bias")}
        keys |= {f"MixerBlock_{i}/{mix}/Dense_{j}/{w}" for mix in ("token_mixing", "channel_mixing") for j in (0, 1)
                 for w in ("kernel", "bias")}
    return keys


# -- ViT ------------------------------------------------------------------------
VIT_CASES = [("vision_transformer", False), ("vision_transformer", True), ("big_vision", False),
             ("big_vision", True), ("timm", False), ("timm", True), ("timm_pth", True)]


@pytest.mark.parametrize("case, class_token", VIT_CASES)
def test_vit_round_trip_is_exact_and_has_the_documented_keys(case, class_token, tmp_path):
    if case == "timm_pth":
        pytest.importorskip("torch")
    format = case.removesuffix("_pth")
    gelu, options = FORMAT_GELU[format], dict(class_token=class_token, representation_size=R if class_token else None)
    model, fresh = vit(**options, gelu_approximate=gelu), vit(**options, gelu_approximate=gelu, seed=2)
    path = str(tmp_path / FILES[case])
    report = round_trip(model, fresh, path, format)
    folded = ("backbone/patch_embedding/class_token", "backbone/patch_embedding/position_embedding")
    changed = folded if format == "big_vision" and class_token else ()
    assert_same_model(model, fresh, changed=changed)
    expected = vit_keys(format, class_token, head=True, pre_logits=class_token)
    assert set(file_arrays(path)) == expected == set(report["keys"])
    if changed:  # big_vision: the class token carries its position, which is zero
        source, loaded = weights(model), weights(fresh)
        positions = source["backbone/patch_embedding/position_embedding"]
        np.testing.assert_array_equal(loaded["backbone/patch_embedding/class_token"][0, 0],
                                      source["backbone/patch_embedding/class_token"][0, 0] + positions[0, 0])
        assert not loaded["backbone/patch_embedding/position_embedding"][0, 0].any()
        np.testing.assert_array_equal(loaded["backbone/patch_embedding/position_embedding"][0, 1:], positions[0, 1:])


def test_timm_orientations(tmp_path):
    model = vit(class_token=True, representation_size=R)
    path = str(tmp_path / "model.safetensors")
    convert.write_checkpoint(model, path, "timm")
    arrays, w = read_safetensors(path), weights(model)
    qkv = arrays["blocks.0.attn.qkv.weight"]
    assert qkv.shape == (3 * D, D)  # torch Linear: (out, in), query / key / value stacked
    np.testing.assert_array_equal(qkv[D:2 * D], w["backbone/block_0/attention/qkv/kernel"][:, D:2 * D].T)  # key
    conv = arrays["patch_embed.proj.weight"]
    assert conv.shape == (D, 3, P, P)  # (out, in, kh, kw)
    assert conv[5, 2, 1, 3] == w["backbone/patch_embedding/projection/kernel"][1, 3, 2, 5]
    assert arrays["blocks.1.mlp.fc1.weight"].shape == (M, D)
    assert arrays["head.weight"].shape == (K, R) and arrays["pre_logits.fc.weight"].shape == (R, D)
    assert arrays["pos_embed"].shape == (1, N + 1, D) and arrays["cls_token"].shape == (1, 1, D)
    with open(path, "rb") as file:  # the safetensors container: aligned header, data back to back
        (size,) = struct.unpack("<Q", file.read(8))
        header, data = json.loads(file.read(size)), file.read()
    assert size % 8 == 0 and header.pop("__metadata__") == {"format": "pt"}
    spans = sorted(info["data_offsets"] for info in header.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_flax_orientations(tmp_path):
    model = vit(class_token=True, gelu_approximate=True)
    w = weights(model)
    qkv = w["backbone/block_1/attention/qkv/kernel"]
    for format, attention in (("vision_transformer", "MultiHeadDotProductAttention_1"),
                              ("big_vision", "MultiHeadDotProductAttention_0")):
        path = str(tmp_path / f"{format}.npz")
        convert.write_checkpoint(model, path, format)
        arrays = read_npz(path)
        prefix = ("" if format == "vision_transformer" else "params/") + f"Transformer/encoderblock_1/{attention}/"
        value = arrays[prefix + "value/kernel"]
        assert value.shape == (D, H, D // H)  # split per projection, (in, heads, head width)
        np.testing.assert_array_equal(value[:, 3], qkv[:, 2 * D + 3 * (D // H):2 * D + 4 * (D // H)])
        assert arrays[prefix + "query/bias"].shape == (H, D // H)
        assert arrays[prefix + "out/kernel"].shape == (H, D // H, D)
    vt, bv = read_npz(str(tmp_path / "vision_transformer.npz")), read_npz(str(tmp_path / "big_vision.npz"))
    assert vt["Transformer/posembed_input/pos_embedding"].shape == (1, N + 1, D)  # the class position first
    assert bv["params/pos_embedding"].shape == (1, N, D)  # no class position


def test_backbone_without_head(tmp_path):
    model, fresh = vit(backbone_only=True), vit(backbone_only=True, seed=2)
    path = str(tmp_path / "backbone.safetensors")
    report = round_trip(model, fresh, path, "timm")
    assert set(report["keys"]) == vit_keys("timm", class_token=False, head=False, pre_logits=False)
    assert_same_model(model, fresh)


# -- MLP-Mixer ------------------------------------------------------------------
@pytest.mark.parametrize("case", ["vision_transformer", "timm", "timm_pth"])
@pytest.mark.parametrize("backbone_only", [False, True])
def test_mixer_round_trip_is_exact_and_has_the_documented_keys(case, backbone_only, tmp_path):
    if case == "timm_pth":
        pytest.importorskip("torch")
    format = case.removesuffix("_pth")
    gelu = FORMAT_GELU[format]
    model, fresh = mixer(backbone_only, gelu), mixer(backbone_only, gelu, seed=2)
    path = str(tmp_path / FILES[case])
    report = round_trip(model, fresh, path, format)
    assert_same_model(model, fresh, size=MIXER["image_size"])
    assert set(report["keys"]) == mixer_keys(format, head=not backbone_only)
    if case == "timm":
        arrays = read_safetensors(path)
        assert arrays["blocks.0.mlp_tokens.fc1.weight"].shape == (MIXER["token_mlp_dim"], S)  # (out, in)
        assert arrays["stem.proj.weight"].shape == (MIXER["hidden_dim"], 3, MIXER["patch_size"], MIXER["patch_size"])
    elif case == "vision_transformer":
        arrays = read_npz(path)
        assert arrays["MixerBlock_1/token_mixing/Dense_0/kernel"].shape == (S, MIXER["token_mlp_dim"])  # (in, out)
        assert set(arrays) == set(report["keys"])


# -- the shipped presets ----------------------------------------------------------
@pytest.mark.parametrize("name, format, file", [
    ("vit_digits", "timm", "vit_digits_timm.safetensors"), ("vit_digits", "big_vision", "vit_digits.npz"),
    ("mixer_digits", "timm", "mixer_digits.safetensors"), ("mixer_digits", "vision_transformer", "mixer_digits.npz"),
])
def test_shipped_presets_round_trip(name, format, file, tmp_path):
    model = presets.from_preset(name)
    fresh = presets.from_preset(name, load_weights=False)
    path = str(tmp_path / file)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*GELU")  # the digits presets compute the exact one
        round_trip(model, fresh, path, format)
    assert_same_model(model, fresh)


# -- keras-hub ----------------------------------------------------------------------
@pytest.mark.parametrize("class_token", [True, False])
def test_keras_hub_preset_folder_round_trip_and_computes_what_keras_hub_does(class_token, tmp_path):
    keras_hub = pytest.importorskip("keras_hub")
    options = dict(class_token=class_token, representation_size=R if class_token else None)
    model, fresh = vit(**options), vit(**options, seed=2)
    path = str(tmp_path / "hub_preset")
    hubs = []

    def from_preset(folder):
        hubs.append(keras_hub.models.ViTImageClassifier.from_preset(folder))
        return hubs[-1]

    report = round_trip(model, fresh, path, "keras_hub", source=from_preset)
    assert_same_model(model, fresh)
    assert any(key.endswith("mha/query/kernel") for key in report["keys"])
    hub = hubs[0]
    assert hub.pooling == ("token" if class_token else "gap") and hub.backbone.use_class_token == class_token
    np.testing.assert_allclose(to_numpy(hub(images())), outputs(model), atol=1e-5)  # keras-hub's own code


def test_keras_hub_backbone_and_overwrite_of_a_folder(tmp_path):
    keras_hub = pytest.importorskip("keras_hub")
    model, fresh = vit(backbone_only=True), vit(backbone_only=True, seed=2)
    path = str(tmp_path / "hub_backbone")
    convert.write_checkpoint(fresh, path, "keras_hub")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        convert.write_checkpoint(model, path, "keras_hub")
    convert.write_checkpoint(model, path, "keras_hub", overwrite=True)
    convert.load_checkpoint(fresh, keras_hub.models.ViTBackbone.from_preset(path), "keras_hub")
    assert_same_model(model, fresh)
    assert os.listdir(tmp_path) == ["hub_backbone"]  # no staging folder left


# -- refusals ---------------------------------------------------------------------------
def test_an_existing_file_is_refused_unless_overwrite(tmp_path):
    path = str(tmp_path / "model.safetensors")
    convert.write_checkpoint(vit(), path, "timm")
    before = open(path, "rb").read()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        convert.write_checkpoint(vit(seed=3), path, "timm")
    assert open(path, "rb").read() == before
    other = vit(seed=3)
    convert.write_checkpoint(other, path, "timm", overwrite=True)
    fresh = vit(seed=2)
    convert.load_checkpoint(fresh, path, "timm")
    assert_same_model(other, fresh)
    assert os.listdir(tmp_path) == ["model.safetensors"]  # no temporary file left
    os.mkdir(tmp_path / "folder.npz")
    with pytest.raises(FileExistsError, match="is a folder"):  # overwrite=True replaces a file with a file only
        convert.write_checkpoint(vit(gelu_approximate=True), str(tmp_path / "folder.npz"), "vision_transformer",
                                 overwrite=True)


def test_bad_format_and_destination_are_named(tmp_path):
    for model, family in ((vit(), VIT_FORMATS), (mixer(), MIXER_FORMATS)):
        with pytest.raises(ValueError, match=r"`format` must be one of " + re.escape(str(family)) + r".*'safetensors'"):
            convert.write_checkpoint(model, str(tmp_path / "m.safetensors"), "safetensors")
    with pytest.raises(ValueError, match="`format` must be one of.*got 'big_vision'"):
        convert.write_checkpoint(mixer(), str(tmp_path / "m.npz"), "big_vision")  # no big_vision Mixer
    with pytest.raises(ValueError, match=r"\.npz files"):
        convert.write_checkpoint(vit(), str(tmp_path / "m.safetensors"), "vision_transformer")
    with pytest.raises(ValueError, match=r"\.safetensors or \.pth"):
        convert.write_checkpoint(vit(), str(tmp_path / "m.npz"), "timm")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert.write_checkpoint(vit(), str(tmp_path / "missing" / "m.npz"), "vision_transformer")
    assert os.listdir(tmp_path) == []


def test_weights_without_a_key_are_refused_or_left_out_with_a_warning(tmp_path):
    backbone = models.MoNEViTBackbone(**TINY, capacity=1.0)
    mone = models.ImageClassifier(backbone, num_classes=K)
    mone.build()
    randomize_weights(mone, seed=1)
    path = str(tmp_path / "mone.safetensors")
    refusal = r"(?s)MoNEViTBackbone has 4 weight.*'backbone/block_0/alpha'.*router_0.*strict=False"
    with pytest.raises(ValueError, match=refusal):
        convert.write_checkpoint(mone, path, "timm")
    assert not os.path.exists(path)
    with pytest.warns(UserWarning, match="router_0"):
        report = convert.write_checkpoint(mone, path, "timm", strict=False)
    assert report["dropped"] and all("router" in p or p.endswith("alpha") for p in report["dropped"])
    dense = vit(seed=2)
    convert.load_checkpoint(dense, path, "timm")  # the dense part, exactly
    found = weights(dense)
    for key, value in weights(mone).items():
        if key in found:
            np.testing.assert_array_equal(found[key], value)


def test_a_gelu_other_than_the_format_s_is_warned_about(tmp_path):
    with pytest.warns(UserWarning, match=r"exact \(erf\) GELU; 'vision_transformer' checkpoints.*tanh"):
        convert.write_checkpoint(vit(gelu_approximate=False), str(tmp_path / "m.npz"), "vision_transformer")
    model = vit(gelu_approximate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # timm computes the exact GELU: nothing to say
        convert.write_checkpoint(model, str(tmp_path / "m.safetensors"), "timm")


def test_video_and_sparse_mlp_models_are_refused(tmp_path):
    video = models.ViViTBackbone(**TINY_VIDEO)
    with pytest.raises(TypeError, match="ViViT"):
        convert.write_checkpoint(video, str(tmp_path / "v.npz"), "vision_transformer")
    sparse = models.SparseMLPBackbone(**SPARSE_MLP_TINY)
    with pytest.raises(TypeError, match="SparseMLPBackbone"):
        convert.write_checkpoint(sparse, str(tmp_path / "s.npz"), "vision_transformer")
    assert os.listdir(tmp_path) == []
