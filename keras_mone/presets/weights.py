"""Weights that ship inside the package: the manifest, checked loading, publishing.

Trained weights live in ``keras_mone.zoo`` under ``weights/`` (``zoo/weights/``
in the repository), one ``<preset>.weights.h5`` per preset (Keras
``save_weights`` of the whole classifier), listed in the machine-written
``weights/manifest.toml``::

    [vit_digits]
    file = "vit_digits.weights.h5"
    sha256 = "..."
    recipe = "cluttered_digits_vit"
    command = "keras-mone train ... && keras-mone presets publish ..."
    [vit_digits.eval]
    setting = "capacity"            # what the accuracy keys are: "capacity" or "width"
    accuracy = { "1.0" = 0.9703 }   # test accuracy per setting
    dataset = "cluttered_digits"    # or "moving_digits" (absent: cluttered_digits)
    test_split = { ... }            # load_cluttered_digits / load_moving_digits arguments

Loading checks the file's sha256 against the manifest before Keras reads it,
so a corrupt, truncated or replaced file is reported by name, never loaded.
"""

import importlib.resources
import os

from keras_mone.file_io import atomic_write_text, sha256_of  # noqa: F401  (sha256_of: this module's public name)

ZOO_PACKAGE = "keras_mone.zoo"
WEIGHTS_FOLDER = "weights"
MANIFEST = "manifest.toml"
#: Extra zoo folders (``os.pathsep``-separated), searched after the bundled zoo:
#: each may hold ``*.toml`` presets and a ``weights/`` folder with its manifest.
ZOO_PATH_ENV = "KERAS_MONE_ZOO_PATH"


def zoo_folders():
    """The bundled zoo folder, then the folders of ``$KERAS_MONE_ZOO_PATH``."""
    folders = [str(importlib.resources.files(ZOO_PACKAGE))]
    extra = os.environ.get(ZOO_PATH_ENV, "")
    folders += [folder for folder in extra.split(os.pathsep) if folder]
    return folders


def load_checked_weights(model, name, entry):
    """Loads the weights of manifest ``entry`` into ``model``; raises ``ValueError``
    naming the file and the expected sha256 if the file is missing, differs
    from the manifest, or does not fit the model."""
    path = os.path.join(entry["folder"], entry["file"])
    expected = entry["sha256"]
    advice = (
        f"Reinstall keras-mone to restore it, or build preset {name!r} with load_weights=False."
    )
    if not os.path.isfile(path):
        raise ValueError(f"Weights file {path!r} of preset {name!r} is missing (sha256 {expected}). {advice}")
    actual = sha256_of(path)
    if actual != expected:
        raise ValueError(
            f"Weights file {path!r} of preset {name!r} is corrupt or was replaced: its sha256 is "
            f"{actual}, the manifest expects {expected}. {advice}"
        )
    try:
        model.load_weights(path)
    except Exception as error:  # Keras raises ValueError / KeyError on shape or layout mismatch
        raise ValueError(
            f"Weights file {path!r} (sha256 {expected}) of preset {name!r} does not fit the model "
            f"that was built: {error}. Arguments that change weight shapes (hidden_dim, depth, "
            "image_size, patch_size, num_classes, ...) cannot be overridden with load_weights=True."
        ) from error


def write_manifest(path, manifest):
    """Writes ``{preset: entry}`` as TOML (sorted, deterministic) to ``path`` atomically."""
    lines = ["# Written by `keras-mone presets publish`; do not edit by hand.", ""]
    for name in sorted(manifest):
        entry = {k: v for k, v in manifest[name].items() if k != "folder"}
        tables = {k: v for k, v in entry.items() if isinstance(v, dict)}
        lines.append(f"[{name}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in entry.items() if key not in tables]
        for key, table in tables.items():
            lines.append(f"[{name}.{key}]")
            lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()]
        lines.append("")
    atomic_write_text(path, "\n".join(lines))


def _toml_key(key):
    return key if key.replace("_", "").isalnum() else f'"{key}"'


def _toml_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    return str(int(value))


