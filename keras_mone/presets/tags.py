"""Weights tags: third-party checkpoints a preset can load, apart from its architecture (timm's ``arch.tag``).

A preset lists its tags in the zoo's TOML files::

    [vit_b16.tags.augreg_in21k_ft_in1k]
    format = "vision_transformer"           # a keras_mone.convert format
    url = "https://storage.googleapis.com/vit_models/augreg/B_16-...-res_224.npz"
    # (format = "keras_hub" tags give a keras-hub `handle` instead of a url)
    sha256 = "..."                          # optional: pins the download
    config = { num_classes = 1000, use_class_token = true, pooling = "token", image_size = 224 }
    top1 = 84.53                            # published ImageNet top-1, recorded in metadata
    license = "Apache-2.0"

and ``default_tag = "..."`` on the preset. A MoNE preset names the dense
preset whose tags it accepts as an initialisation (``tags_from = "vit_b16"``):
its routers and smaller experts then start untrained. The checkpoint is
downloaded and converted on first use, and the converted model is cached as a
preset folder (``$KERAS_HOME/keras_mone/converted/``), so later calls, and
offline use, read the folder.
"""

import hashlib
import json
import os

import keras

from keras_mone.presets.folder import WEIGHTS_FILE, check_folder, is_preset_folder, save_to_preset
from keras_mone.presets.handles import cache_root, download


def preset_tags(spec, zoo):
    """``{tag: tag entry}`` a preset accepts (its own or those of ``tags_from``)."""
    if "tags" in spec:
        return spec["tags"]
    source = spec.get("tags_from")
    return zoo[source].get("tags", {}) if source in zoo else {}


def tag_entry(name, spec, zoo, tag):
    tags = preset_tags(spec, zoo)
    if tag is None:
        tag = spec.get("default_tag") or zoo.get(spec.get("tags_from"), {}).get("default_tag")
    if tag not in tags:
        raise ValueError(
            f"Preset {name!r} has no weights tag {tag!r}; its tags: {sorted(tags) or 'none'}."
        )
    return tag, tags[tag]


def load_tagged_weights(model, name, tag, entry, untrained_parts=(), force_download=False):
    """Loads tag ``entry`` into built ``model`` through the converted-checkpoint cache
    (``force_download``: download and convert again)."""
    from keras_mone import convert

    origin = entry.get("url") or entry["handle"]
    config = json.dumps(keras.saving.serialize_keras_object(model), sort_keys=True)
    key = hashlib.sha256(f"{origin}|{config}".encode()).hexdigest()[:16]
    folder = os.path.join(cache_root(), "converted", f"{name}.{tag}.{key}")
    if is_preset_folder(folder) and not force_download:
        check_folder(folder)
        model.load_weights(os.path.join(folder, WEIGHTS_FILE))
        return model
    if entry["format"] == "keras_hub":
        source = _keras_hub_model(entry["handle"])
    else:
        source = download(entry["url"], sha256=entry.get("sha256"), force_download=force_download)
    report = convert.load_checkpoint(model, source, entry["format"])
    save_to_preset(
        model, folder, overwrite=True, weights_source=origin, license=entry.get("license", "unknown"),
        accuracy={"imagenet_top1_published": entry["top1"]} if "top1" in entry else None,
        weights_tag=tag, untrained=sorted(report["kept"]) + list(untrained_parts),
    )
    return model


def _keras_hub_model(handle):
    try:
        import keras_hub
    except ImportError as error:
        raise ImportError(
            "This weights tag is a keras-hub preset: pip install --no-deps keras-hub (with its "
            "dependencies regex and tokenizers) to load it."
        ) from error
    return keras_hub.models.ViTImageClassifier.from_preset(handle)
