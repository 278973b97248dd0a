"""Converters from third-party ViT checkpoints into keras_mone models.

One module per source format; the caller names the format (nothing is
guessed from key names):

    from keras_mone import convert, presets
    model = presets.from_preset("vit_b16", load_weights=False, use_class_token=True,
                                pooling="token", num_classes=1000, gelu_approximate=True)
    report = convert.load_checkpoint(model, "B_16-i21k-...res_224.npz", "vision_transformer")
    convert.load_checkpoint(model, "model.safetensors", "timm")
    convert.load_checkpoint(model, keras_hub_backbone, "keras_hub")

Loading is strict by default: every checkpoint key is used or named in an
error before anything is written (``strict=False`` skips the keys the model
has no part for, with a warning naming them, and the report's ``"unused"``
lists them; a missing or misshaped weight is an error in either mode). Flax checkpoints (AugReg, big_vision)
compute the tanh-approximate GELU: build their model with
``gelu_approximate=True`` (the report's ``"gelu_approximate"`` says which
GELU a checkpoint needs; a mismatch is warned about).

Every converter yields the same ViT state (``vit_state``), which loads into a
dense ViT, a MoNE-ViT (routers freshly initialised) or their classifiers; a
ViViT-FE then starts from the image model with
``keras_mone.models.vivit_from_image_backbone``.

A ``MixerBackbone`` (or an ``ImageClassifier`` on one) takes MLP-Mixer
checkpoints instead, formats ``"vision_transformer"`` (flax ``.npz``: build
with ``gelu_approximate=True``) and ``"timm"`` (``keras_mone.methods.mixer.checkpoints``).

``write_checkpoint(model, path, format)`` is the inverse (``keras_mone.convert.writer``):
it writes a model in a format's key layout, so that ``load_checkpoint`` into a
fresh model of the same configuration reproduces it.
"""

import os

from keras_mone.convert import big_vision, keras_hub, timm  # noqa: F401
from keras_mone.convert.loaders import loader_for, register_checkpoint_loader
from keras_mone.convert.checkpoint_file import read_checkpoint_file
from keras_mone.convert.vit_state import load_vit_state
from keras_mone.convert.writer import write_checkpoint

FORMATS = ("vision_transformer", "big_vision", "timm", "keras_hub")


def read_vit_state(source, format):
    """The ViT state of ``source`` (a file path, or a keras-hub model for ``"keras_hub"``)."""
    if format not in FORMATS:
        raise ValueError(f"`format` must be one of {FORMATS}, got {format!r}.")
    if format == "keras_hub":
        return keras_hub.vit_state_from_keras_hub(source)
    return read_checkpoint_file(
        source, format, big_vision.LAYOUTS, lambda arrays: big_vision.vit_state_from_npz(arrays, format),
        timm.vit_state_from_timm, hint="; a keras-hub model object takes format 'keras_hub'",
    )


def load_checkpoint(model, source, format, strict=True):
    """Loads a third-party ViT checkpoint into ``model``; returns the report of ``load_vit_state``.

    ``strict`` (default): a checkpoint key the model would not use (a head of
    another class count, a class token the model lacks, layer scale, a MAP
    head, ...) is an error naming every such key, and nothing is written.
    ``strict=False`` skips those keys, warning with each key and its reason
    (the report's ``"unused"`` lists them too). Either way, a missing or
    misshaped weight is an error and nothing is written.
    A backbone family with its own formats loads through the loader it registered
    (``convert.loaders``): a Mixer model loads an MLP-Mixer checkpoint
    (``keras_mone.methods.mixer.checkpoints.load_mixer_state``).
    """
    name = source if isinstance(source, (str, os.PathLike)) else type(source).__name__
    family_loader = loader_for(model)  # e.g. MLP-Mixer's own formats (keras_mone.convert.loaders)
    if family_loader is not None:
        return family_loader(model, source, format, strict, name)
    state = read_vit_state(source, format)
    return load_vit_state(model, state, source=f"{format} checkpoint {name!r}", strict=strict)


__all__ = [
    "FORMATS", "load_checkpoint", "load_vit_state", "read_vit_state", "register_checkpoint_loader", "write_checkpoint",
]
