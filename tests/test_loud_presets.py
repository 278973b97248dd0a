"""Presets and converters say what they do (issue 42 items on presets and checkpoints).

``from_preset(weights=TAG, load_weights=False)`` downloads nothing and names
both arguments; ``evaluation_data`` of a preset folder says only shipped
presets have test data; ``strict=False`` skips only keys the model has no
part for, warning with each one, and a shape mismatch or missing key stays an
error saying so; ``save_to_preset`` into a read-only place names the folder
passed; an unknown checkpoint key names the model class it does not belong to.
"""

import errno
import os
import re
import warnings

import keras
import numpy as np
import pytest

from keras_mone import convert, presets
from keras_mone.presets import folder as preset_folder
from keras_mone.presets import handles, tags
from test_convert import reference_params
from test_convert_mixer import DS, FORMATS, S, flax_arrays
from test_convert_mixer import _npz as mixer_npz
from test_convert_mixer import classifier as mixer_classifier
from test_convert_strict import ONES, _vt
from test_convert_strict import build as vit_classifier
from test_preset_handles import tiny_classifier


def weights_of(model):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in model.weights]


def load_recording(model, path, format, **kwargs):
    """``(report, [warning texts])`` of ``convert.load_checkpoint``, GELU notes left out."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = convert.load_checkpoint(model, path, format, **kwargs)
    return report, [str(w.message) for w in caught if "GELU" not in str(w.message)]


# -- item 1: weights=TAG with load_weights=False ------------------------------------


@pytest.fixture
def no_downloads(monkeypatch, tmp_path):
    """Every way a weights tag could be fetched fails loudly and is recorded."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise AssertionError(f"a download was attempted: {args}")

    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))  # no converted copy in the cache
    monkeypatch.setattr(tags, "download", refuse)
    monkeypatch.setattr(tags, "_keras_hub_model", refuse)
    monkeypatch.setattr(handles, "download", refuse)
    monkeypatch.setattr(keras.utils, "get_file", refuse)
    return attempts


@pytest.mark.parametrize("name, tag", [("vit_ti16", "augreg_in21k_ft_in1k"), ("mone_vit_s16", "augreg_in21k"),
                                       ("mixer_b16", "imagenet1k")])
def test_weights_tag_without_load_weights_is_refused_and_downloads_nothing(no_downloads, name, tag):
    # Rules out downloading (and, online, silently loading) a tag when load_weights=False was passed.
    with pytest.raises(ValueError) as error:
        presets.from_preset(name, weights=tag, load_weights=False, depth=1, image_size=32)
    text = str(error.value)
    assert f"weights={tag!r}" in text and "load_weights=False" in text and "nothing was downloaded" in text
    assert no_downloads == []
    if name != "mixer_b16":
        assert "use_class_token=True" in text and "pooling='token'" in text  # the tag's architecture, to pass
    model = presets.from_preset(name, load_weights=False, depth=1, image_size=32)  # still builds, offline
    assert model.backbone.depth == 1 and no_downloads == []


# -- item 2: evaluation_data of something that is not a shipped preset ----------------


def test_evaluation_data_of_a_preset_folder_points_to_the_shipped_presets(tmp_path):
    # Rules out "Unknown preset" for a folder: it is a preset, just not one with a recorded test split.
    target = tmp_path / "mine"
    presets.save_to_preset(tiny_classifier(), target)
    for handle in (str(target), target, "no_such_preset"):
        with pytest.raises(ValueError) as error:
            presets.evaluation_data(handle)
        text = str(error.value)
        assert "Unknown preset" not in text and "only shipped presets have evaluation data" in text
        assert repr(str(handle)) in text and "vit_digits" in text and "keras-mone presets list" in text
    with pytest.raises(ValueError, match="'vit_ti16' ships no trained weights.*only shipped presets.*vit_digits"):
        presets.evaluation_data("vit_ti16")


# -- item 3: what strict=False relaxes, and that it says so ---------------------------


def test_strict_false_warns_with_every_skipped_key(tmp_path):
    # Rules out strict=False dropping checkpoint keys with no word (only the returned report named them).
    vit = vit_classifier()
    report, texts = load_recording(vit, str(_vt(reference_params(), tmp_path, **{"Transformer/extra/scale": ONES})),
                                   "vision_transformer", strict=False)
    assert list(report["unused"]) == ["Transformer/extra/scale"]
    assert any("strict=False skipped 1 key" in t and "'Transformer/extra/scale'" in t for t in texts), texts
    model = mixer_classifier(True, num_classes=3)  # the checkpoint's head has 5 classes
    report, texts = load_recording(model, mixer_npz(tmp_path, flax_arrays()), "vision_transformer", strict=False)
    assert set(report["unused"]) == {"head/kernel", "head/bias"}
    [text] = [t for t in texts if "strict=False skipped" in t]
    assert "2 key(s)" in text and "'head/kernel'" in text and "'head/bias'" in text and "num_classes=5" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a checkpoint that loads whole warns about nothing
        convert.load_checkpoint(mixer_classifier(True), mixer_npz(tmp_path, flax_arrays()), "vision_transformer",
                                strict=False)


@pytest.mark.parametrize("format", sorted(FORMATS))
def test_strict_false_still_refuses_a_misshaped_or_missing_weight_and_says_so(format, tmp_path):
    # Rules out the docs' "loads what fits" promising more than strict=False does: the error says it is no remedy.
    make, write, _, source_gelu = FORMATS[format]
    key = "MixerBlock_0/token_mixing/Dense_0/kernel" if format == "vision_transformer" else "blocks.0.mlp_tokens.fc1.weight"
    model = mixer_classifier(source_gelu, token_mlp_dim=DS + 4)
    before = weights_of(model)
    with pytest.raises(ValueError, match=f"(?s){re.escape(repr(key))} .*{S}, {DS}.*strict=False does not relax this"):
        load_recording(model, write(tmp_path, make()), format, strict=False)
    assert all(np.array_equal(a, b) for a, b in zip(before, weights_of(model)))  # nothing written
    missing = "MixerBlock_1/channel_mixing/Dense_1/bias" if format == "vision_transformer" else "blocks.1.norm2.bias"
    arrays = make()
    del arrays[missing]
    model = mixer_classifier(source_gelu)
    before = weights_of(model)
    with pytest.raises(ValueError, match=f"has no {re.escape(repr(missing))} .*also with strict=False"):
        load_recording(model, write(tmp_path, arrays), format, strict=False)
    assert all(np.array_equal(a, b) for a, b in zip(before, weights_of(model)))


# -- item 4: save_to_preset where it may not write -----------------------------------


def test_save_to_preset_into_a_read_only_place_names_the_folder_passed(tmp_path, monkeypatch):
    # Rules out an error naming the hidden '.preset-XXXX' staging sibling instead of the folder passed.
    parent = tmp_path / "read_only"
    parent.mkdir()
    target = parent / "mine"
    os.chmod(parent, 0o555)
    try:
        if os.access(parent, os.W_OK):  # root: chmod does not stop it, so the staging folder's creation fails here
            real_mkdtemp = preset_folder.tempfile.mkdtemp

            def read_only_mkdtemp(suffix=None, prefix=None, dir=None):
                if dir is not None and os.path.samefile(dir, parent):
                    name = os.path.join(dir, f"{prefix}abc123")
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), name)
                return real_mkdtemp(suffix, prefix, dir)

            monkeypatch.setattr(preset_folder.tempfile, "mkdtemp", read_only_mkdtemp)
        with pytest.raises(PermissionError) as error:
            presets.save_to_preset(tiny_classifier(), target)
        text = str(error.value)
        assert repr(str(target)) in text and "not writable" in text and ".preset-" not in text
        assert os.listdir(parent) == []  # nothing left behind
    finally:
        os.chmod(parent, 0o755)


# -- item 5: an unknown key names the model family it is no part of ------------------


def test_unknown_checkpoint_key_names_the_target_model_class(tmp_path):
    # Rules out a Mixer checkpoint's extra key being called "not a part of keras_mone's ViT".
    extra = "MixerBlock_0/extra/kernel"
    path = mixer_npz(tmp_path, {**flax_arrays(), extra: np.ones(3, "float32")})
    with pytest.raises(ValueError, match=f"{re.escape(repr(extra))}: not a part of keras_mone's MixerBackbone") as error:
        load_recording(mixer_classifier(True), path, "vision_transformer")
    assert "ViT" not in str(error.value)
    report, _ = load_recording(mixer_classifier(True), path, "vision_transformer", strict=False)
    assert "MixerBackbone" in report["unused"][extra] and "ViT" not in report["unused"][extra]
    vit_path = str(_vt(reference_params(), tmp_path, **{"Transformer/extra/scale": ONES}))
    with pytest.raises(ValueError, match="'Transformer/extra/scale': not a part of keras_mone's ViTBackbone"):
        load_recording(vit_classifier(), vit_path, "vision_transformer")
