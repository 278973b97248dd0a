"""Converters from third-party ViT checkpoints into keras_mone models.

One module per source format; the caller names the format (nothing is
guessed from key names):

    from keras_mone import convert, presets
    model = presets.from_preset("vit_b16", load_weights=False, use_class_token=True,
                                pooling="token", num_classes=1000)
    convert.load_checkpoint(model, "B_16-i21k-...res_224.npz", "vision_transformer")
    convert.load_checkpoint(model, "model.safetensors", "timm")
    convert.load_checkpoint(model, keras_hub_backbone, "keras_hub")

Every converter yields the same ViT state (``vit_state``), which loads into a
dense ViT, a MoNE-ViT (routers freshly initialised) or their classifiers; a
ViViT-FE then starts from the image model with
``keras_mone.models.vivit_from_image_backbone``.
"""

import os

from keras_mone.convert import big_vision, keras_hub, timm
from keras_mone.convert.vit_state import load_vit_state

FORMATS = ("vision_transformer", "big_vision", "timm", "keras_hub")


def read_vit_state(source, format):
    """The ViT state of ``source`` (a file path, or a keras-hub model for ``"keras_hub"``)."""
    if format not in FORMATS:
        raise ValueError(f"`format` must be one of {FORMATS}, got {format!r}.")
    if format == "keras_hub":
        return keras_hub.vit_state_from_keras_hub(source)
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Checkpoint {path!r} does not exist.")
    if format in big_vision.LAYOUTS:
        return big_vision.vit_state_from_npz(big_vision.read_npz(path), format)
    if path.endswith(".safetensors"):
        return timm.vit_state_from_timm(timm.read_safetensors(path))
    if path.endswith((".pth", ".pt", ".bin")):
        return timm.vit_state_from_timm(timm.read_pth(path))
    raise ValueError(f"timm checkpoints are .safetensors or .pth files, got {path!r}.")


def load_checkpoint(model, source, format):
    """Loads a third-party ViT checkpoint into ``model``; returns the report of ``load_vit_state``."""
    name = source if isinstance(source, (str, os.PathLike)) else type(source).__name__
    return load_vit_state(model, read_vit_state(source, format), source=f"{format} checkpoint {name!r}")


__all__ = ["FORMATS", "load_checkpoint", "load_vit_state", "read_vit_state"]
