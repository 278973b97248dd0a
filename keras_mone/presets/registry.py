"""Preset registry: reads ``keras_mone.zoo/*.toml`` and builds models from it.

One merge rule: ``{**size table, **preset, **caller's keyword arguments}``.
"""

import copy
import functools
import os
import tomllib

from keras_mone.layers.config import config_argument_names
from keras_mone.data import image_converter
from keras_mone.models.backbone import PRESET_HOOKS
from keras_mone.methods.registry import ARCHITECTURES, TASKS, architectures
from keras_mone.presets.folder import is_preset_folder, load_preset_folder
from keras_mone.presets.handles import URL_SCHEMES, fetch_preset_folder, is_remote, resolve_hub_handle
from keras_mone.presets.tags import load_tagged_weights, preset_tags, tag_entry
from keras_mone.presets.untrained import untrained_parts, warn_untrained
from keras_mone.presets.weights import MANIFEST, WEIGHTS_FOLDER, load_checked_weights, zoo_folders

META_KEYS = ("description", "architecture", "variant", "weights", "tags", "default_tag", "tags_from")


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


def weights_tags(name):
    """``{tag: description}`` of the third-party weights preset ``name`` can load."""
    spec = get_preset(name)
    return {tag: entry.get("description", entry.get("url", entry.get("handle"))) for tag, entry in preset_tags(spec, _zoo()).items()}


def from_preset(name, /, load_weights=True, weights=None, sha256=None, force_download=False, **overrides):
    """Builds a model from a preset handle.

    Handles: a built-in name (``list_presets()``); a local preset folder
    (``save_to_preset``); an ``https://`` URL of a preset folder (``sha256``
    pins its ``metadata.json``); ``hf://owner/repo``;
    ``kaggle://owner/model/framework/variation[/version]``.

    Built-in names give ``ImageClassifier`` or ``VideoClassifier``
    (``MatViTClassifier`` / ``MatViViTClassifier`` for the nested-width
    presets, whose ``set_width`` picks the width). A routed preset loading a
    dense checkpoint tag warns (``UntrainedWeightsWarning``): its routers and
    smaller experts start untrained; at capacity 1.0 it equals the checkpoint.

    Args:
        name: the handle.
        load_weights: load weights: the trained weights that ship with the
            preset (sha256-checked), else its default weights tag; raises if
            it has neither (``load_weights=False`` builds it randomly
            initialised).
        weights: a weights tag (``weights_tags(name)``), e.g.
            ``"augreg_in21k_ft_in1k"``: a third-party checkpoint, downloaded
            and converted on first use, then cached. Built-in names only (a
            preset folder holds one set of weights). With
            ``load_weights=False`` it is refused (nothing is downloaded).
        sha256: for folder, ``https://`` and hub handles, the expected sha256
            of the folder's ``metadata.json`` (which pins the other files).
        force_download: download again although the handle or tag is cached
            (an unpinned ``https://`` handle otherwise keeps its cached copy).
        **overrides: constructor arguments of the backbone or the classifier
            (``capacity``, ``image_size``, ``num_classes``, ``pooling``, ...);
            they override the preset's values.
    """
    if _is_handle(name):
        _refuse_weights_for_handle(name, weights)
        return _from_handle(os.fspath(name), load_weights, sha256, force_download, overrides)
    _refuse_sha256_for_name(name, sha256)
    spec = get_preset(name)
    if weights is not None and not load_weights:
        _refuse_tag_without_weights(name, spec, weights)
    tag, tag_spec = _weights_tag(name, spec, load_weights, weights)
    if tag is not None:
        overrides = {**tag_spec.get("config", {}), **overrides}
    model, backbone = _build_preset_model(name, spec, overrides)
    if tag is not None:
        load_tagged_weights(model, name, tag, tag_spec, untrained_parts(backbone, spec["architecture"]), force_download)
        warn_untrained(model, name, tag, spec["architecture"], spec["variant"])
    elif load_weights:
        load_checked_weights(model, name, spec["weights"])
    return model


def _is_handle(name):
    """Whether ``name`` is a preset folder or a remote handle rather than a built-in preset name."""
    if isinstance(name, os.PathLike):
        return True
    return isinstance(name, str) and (is_remote(name) or os.sep in name or is_preset_folder(name))


def _refuse_weights_for_handle(handle, weights):
    """The ``ValueError`` for ``weights=TAG`` with a folder or handle, which holds one set of weights."""
    if weights is not None:
        raise ValueError(
            f"weights={weights!r} applies to built-in preset names; {os.fspath(handle)!r} is a preset "
            "folder or handle, which holds one set of weights. Drop `weights`."
        )


def _refuse_sha256_for_name(name, sha256):
    """The ``ValueError`` for ``sha256=`` with a built-in name, which the package's manifest checks."""
    if sha256 is not None:
        raise ValueError(
            f"sha256= pins the metadata.json of a preset folder or handle; built-in preset {name!r} is "
            "checked against the package's manifest. Drop `sha256`."
        )


def _weights_tag(name, spec, load_weights, weights):
    """``(tag, its entry)`` of the third-party weights to load, ``(None, None)`` for none or the shipped ones."""
    if weights is not None or (load_weights and not spec.get("weights") and (preset_tags(spec, _zoo()))):
        return tag_entry(name, spec, _zoo(), weights)
    if load_weights and not spec.get("weights"):
        raise ValueError(
            f"Preset {name!r} has no published weights yet (presets with weights: "
            f"{', '.join(shipped_presets()) or 'none'}). Pass load_weights=False to build "
            "the architecture with random initialisation."
        )
    return None, None


def _build_preset_model(name, spec, overrides):
    """``(task model, its backbone)`` of a built-in preset, built without weights; unknown arguments are refused."""
    backbone_cls = ARCHITECTURES[spec["architecture"]]
    task_cls = TASKS[spec["architecture"]]
    config = {**architectures()[spec["architecture"]].decode_variant(spec["variant"])}
    config.update({k: v for k, v in spec.items() if k not in META_KEYS})
    config.update(overrides)
    task_keys = set(config_argument_names(task_cls)) - {"backbone"}
    backbone_keys = set(config_argument_names(backbone_cls)) | {"dtype", "name"}
    unknown = sorted(set(config) - task_keys - backbone_keys)
    if unknown:
        raise ValueError(
            f"Unknown argument(s) {unknown} for preset {name!r}. Allowed: "
            f"{sorted((task_keys | backbone_keys) - {'dtype', 'name'})}."
        )
    backbone = architectures()[spec["architecture"]].build_backbone(
        **{k: v for k, v in config.items() if k in backbone_keys and k != "name"}
    )
    task_config = {k: v for k, v in config.items() if k in task_keys}
    if "dtype" in config:
        task_config["dtype"] = config["dtype"]
    model = task_cls(backbone, name=config.get("name", name), **task_config)
    model.build()
    return model, backbone


def _refuse_tag_without_weights(name, spec, weights):
    """The ``ValueError`` for ``weights=TAG`` with ``load_weights=False``: no download, no guess."""
    config = preset_tags(spec, _zoo()).get(weights, {}).get("config")
    hint = (f" To build the architecture that tag loads into without its weights, pass its configuration "
            f"instead: {', '.join(f'{k}={v!r}' for k, v in config.items())}.") if config else ""
    raise ValueError(
        f"from_preset({name!r}): weights={weights!r} asks for a checkpoint but load_weights=False asks "
        f"for none; nothing was downloaded. Pass weights= to load that tag, or load_weights=False without "
        f"weights= to build the architecture randomly initialised.{hint}"
    )


def _from_handle(handle, load_weights, sha256, force_download, overrides):
    if handle.startswith(URL_SCHEMES):
        folder = fetch_preset_folder(handle, sha256=sha256, force_download=force_download)
    elif is_remote(handle):
        folder = resolve_hub_handle(handle, force_download=force_download)
    elif is_preset_folder(handle):
        folder = handle
    else:
        raise ValueError(
            f"{handle!r} is neither a preset name ({', '.join(list_presets())}) nor a preset folder "
            "(config.json, model.weights.h5, metadata.json)."
        )
    return load_preset_folder(folder, load_weights=load_weights, sha256=sha256, **overrides)


def _preset_classes(name):
    """``(task class, backbone class)`` of a built-in preset name, else ``None``."""
    if not isinstance(name, str) or name not in _zoo():
        return None
    architecture = _zoo()[name]["architecture"]
    return TASKS[architecture], ARCHITECTURES[architecture]


PRESET_HOOKS.update(build=from_preset, classes=_preset_classes)  # ImageClassifier / Backbone.from_preset
image_converter.PRESET_LOOKUP = get_preset  # ImageConverter.for_preset
