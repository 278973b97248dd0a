"""Preset registry: reads ``keras_mone.zoo/*.toml`` and builds models from it.

One merge rule: ``{**size table, **preset, **caller's keyword arguments}``.
"""

import functools
import importlib.resources
import tomllib

from keras_mone.layers.config import config_argument_names
from keras_mone.models.architectures import ARCHITECTURES, TASKS
from keras_mone.models.variants import decode_variant

_META_KEYS = ("description", "architecture", "variant", "weights")


@functools.lru_cache(maxsize=1)
def _load_zoo():
    presets = {}
    for entry in importlib.resources.files("keras_mone.zoo").iterdir():
        if not entry.name.endswith(".toml"):
            continue
        for name, spec in tomllib.loads(entry.read_text()).items():
            if name in presets:
                raise RuntimeError(f"Preset {name!r} is defined twice in keras_mone.zoo.")
            presets[name] = spec
    return presets


def list_presets():
    """Names of all presets, sorted."""
    return sorted(_load_zoo())


def get_preset(name):
    """The preset's definition (a copy): description, architecture, variant, arguments."""
    presets = _load_zoo()
    if name not in presets:
        raise ValueError(f"Unknown preset {name!r}. Available presets: {', '.join(sorted(presets))}.")
    return dict(presets[name])


def from_preset(name, /, load_weights=True, **overrides):
    """Builds the classifier of preset ``name``: ``ImageClassifier`` or
    ``VideoClassifier``; ``MatViTClassifier`` / ``MatViViTClassifier`` for the
    nested-width presets (``set_width`` picks the width).

    Args:
        name: a name from ``list_presets()``.
        load_weights: load the preset's published weights; raises if the
            preset has none yet (use ``load_weights=False`` for a randomly
            initialised model).
        **overrides: constructor arguments of the backbone or the classifier
            (``capacity``, ``image_size``, ``num_classes``, ``pooling``, ...);
            they override the preset's values.
    """
    spec = get_preset(name)
    if load_weights and not spec.get("weights"):
        raise ValueError(
            f"Preset {name!r} has no published weights yet. Pass load_weights=False to build "
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
    return model
