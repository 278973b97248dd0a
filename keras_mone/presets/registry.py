"""Preset registry: reads ``keras_mone.zoo/*.toml`` and builds models from it.

One merge rule: ``{**size table, **preset, **caller's keyword arguments}``.
"""

import copy
import functools
import os
import tomllib

from keras_mone.layers.config import config_argument_names
from keras_mone.models.architectures import ARCHITECTURES, TASKS
from keras_mone.models.variants import decode_variant
from keras_mone.presets.weights import MANIFEST, WEIGHTS_FOLDER, load_checked_weights, zoo_folders

_META_KEYS = ("description", "architecture", "variant", "weights")


@functools.lru_cache(maxsize=4)
def _load_zoo(folders):
    presets, manifest = {}, {}
    for folder in folders:
        for file in sorted(os.listdir(folder)):
            if not file.endswith(".toml"):
                continue
            with open(os.path.join(folder, file), "rb") as f:
                for name, spec in tomllib.load(f).items():
                    if name in presets:
                        raise RuntimeError(f"Preset {name!r} is defined twice (again in {folder}/{file}).")
                    presets[name] = spec
        manifest_path = os.path.join(folder, WEIGHTS_FOLDER, MANIFEST)
        if os.path.isfile(manifest_path):
            with open(manifest_path, "rb") as f:
                for name, entry in tomllib.load(f).items():
                    manifest[name] = {**entry, "folder": os.path.join(folder, WEIGHTS_FOLDER)}
    for name, entry in manifest.items():
        if name not in presets:
            raise RuntimeError(f"The weights manifest of {entry['folder']} lists {name!r}, which no preset defines.")
        presets[name] = {**presets[name], "weights": entry}
    return presets


def _zoo():
    return _load_zoo(tuple(zoo_folders()))


def list_presets():
    """Names of all presets, sorted."""
    return sorted(_zoo())


def shipped_presets():
    """Names of the presets whose trained weights ship with the package, sorted."""
    return sorted(name for name, spec in _zoo().items() if spec.get("weights"))


def get_preset(name):
    """The preset's definition (a copy): description, architecture, variant,
    arguments and, for shipped presets, its ``weights`` manifest entry."""
    presets = _zoo()
    if name not in presets:
        raise ValueError(f"Unknown preset {name!r}. Available presets: {', '.join(sorted(presets))}.")
    return copy.deepcopy(presets[name])


def from_preset(name, /, load_weights=True, **overrides):
    """Builds the classifier of preset ``name``: ``ImageClassifier`` or
    ``VideoClassifier``; ``MatViTClassifier`` / ``MatViViTClassifier`` for the
    nested-width presets (``set_width`` picks the width).

    Args:
        name: a name from ``list_presets()``.
        load_weights: load the weights that ship with the preset (see
            ``shipped_presets()``), after checking their sha256; raises if the
            preset has none (use ``load_weights=False`` for a randomly
            initialised model).
        **overrides: constructor arguments of the backbone or the classifier
            (``capacity``, ``image_size``, ``num_classes``, ``pooling``, ...);
            they override the preset's values.
    """
    spec = get_preset(name)
    if load_weights and not spec.get("weights"):
        raise ValueError(
            f"Preset {name!r} has no published weights yet (presets with weights: "
            f"{', '.join(shipped_presets()) or 'none'}). Pass load_weights=False to build "
            "the architecture with random initialisation."
        )
    backbone_cls = ARCHITECTURES[spec["architecture"]]
    task_cls = TASKS[spec["architecture"]]
    config = {**decode_variant(spec["variant"])}
    config.update({k: v for k, v in spec.items() if k not in _META_KEYS})
    config.update(overrides)
    task_keys = set(config_argument_names(task_cls)) - {"backbone"}
    backbone_keys = set(config_argument_names(backbone_cls)) | {"dtype", "name"}
    unknown = sorted(set(config) - task_keys - backbone_keys)
    if unknown:
        raise ValueError(
            f"Unknown argument(s) {unknown} for preset {name!r}. Allowed: "
            f"{sorted((task_keys | backbone_keys) - {'dtype', 'name'})}."
        )
    backbone = backbone_cls(
        **{k: v for k, v in config.items() if k in backbone_keys and k != "name"}
    )
    task_config = {k: v for k, v in config.items() if k in task_keys}
    if "dtype" in config:
        task_config["dtype"] = config["dtype"]
    model = task_cls(backbone, name=config.get("name", name), **task_config)
    model.build()
    if load_weights:
        load_checked_weights(model, name, spec["weights"])
    return model
