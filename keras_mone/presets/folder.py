"""Preset folders, keras-hub's convention: ``config.json``, ``model.weights.h5``, ``metadata.json``.

``save_to_preset(model, path)`` writes one (atomically: into a sibling
temporary folder, renamed at the end); ``load_preset_folder(path)`` checks
every file's sha256 against ``metadata.json`` before Keras reads it, builds
the model from ``config.json`` and loads the weights only if every variable's
shape fits (``SafeLoadingMixin``), so a folder whose config and weights
disagree fails naming the mismatched shapes, and nothing half-loads.
"""

import json
import os
import shutil
import tempfile

import keras

from keras_mone.presets.weights import sha256_of
from keras_mone.version import __version__

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.weights.h5"
METADATA_FILE = "metadata.json"


def save_to_preset(model, path, weights_source="keras_mone", license="Apache-2.0", accuracy=None, **extra):
    """Writes ``model`` as a preset folder at ``path`` (replaced if it exists).

    Args:
        model: a built keras_mone classifier or backbone.
        path: the folder to write.
        weights_source: where the weights come from (a checkpoint URL, a recipe, ...).
        license: the weights' licence.
        accuracy: optional ``{setting: top-1}`` to record.
        **extra: more metadata entries (JSON-serialisable).

    Returns:
        The metadata written.
    """
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".preset-", dir=parent)
    try:
        with open(os.path.join(staging, CONFIG_FILE), "w") as f:
            json.dump(keras.saving.serialize_keras_object(model), f, indent=2)
        model.save_weights(os.path.join(staging, WEIGHTS_FILE))
        metadata = {
            "keras_mone_version": __version__,
            "keras_version": keras.__version__,
            "class_name": type(model).__name__,
            "parameter_count": int(model.count_params()),
            "weights_source": weights_source,
            "license": license,
            **({"accuracy": accuracy} if accuracy else {}),
            **extra,
            "sha256": {name: sha256_of(os.path.join(staging, name)) for name in (CONFIG_FILE, WEIGHTS_FILE)},
        }
        with open(os.path.join(staging, METADATA_FILE), "w") as f:
            json.dump(metadata, f, indent=2)
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return metadata


def is_preset_folder(path):
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG_FILE))


def read_metadata(path):
    file = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"Preset folder {path!r} has no {METADATA_FILE}.")
    with open(file) as f:
        return json.load(f)


def check_folder(path):
    """Raises a ``ValueError`` naming the file if a file's sha256 differs from ``metadata.json``."""
    expected = read_metadata(path).get("sha256", {})
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        file = os.path.join(path, name)
        if name not in expected:
            raise ValueError(f"{METADATA_FILE} of preset folder {path!r} records no sha256 for {name}.")
        if not os.path.isfile(file):
            raise ValueError(f"Preset folder {path!r} is missing {name} (sha256 {expected[name]}).")
        actual = sha256_of(file)
        if actual != expected[name]:
            raise ValueError(
                f"{file!r} is corrupt or was replaced: its sha256 is {actual}, "
                f"{METADATA_FILE} records {expected[name]}."
            )


def load_preset_folder(path, load_weights=True, **overrides):
    """The model saved in preset folder ``path``.

    ``overrides`` replace entries of the saved configuration (the
    classifier's or its backbone's, e.g. ``capacity``); an argument that
    changes a weight shape then fails the weights check with the shapes named.
    """
    path = os.fspath(path)
    check_folder(path)
    with open(os.path.join(path, CONFIG_FILE)) as f:
        config = json.load(f)
    if overrides:
        config = _with_overrides(config, overrides, path)
    model = keras.saving.deserialize_keras_object(config)
    if not model.built:
        model.build()
    if load_weights:
        model.load_weights(os.path.join(path, WEIGHTS_FILE))
    return model


def _with_overrides(config, overrides, path):
    config = json.loads(json.dumps(config))
    task = config["config"]
    backbone = task.get("backbone", {}).get("config", {}) if isinstance(task.get("backbone"), dict) else {}
    for key, value in overrides.items():
        if key in task and key != "backbone":
            task[key] = value
        elif key in backbone:
            backbone[key] = value
        else:
            raise ValueError(
                f"Unknown argument {key!r} for preset folder {path!r}. Allowed: "
                f"{sorted(set(task) | set(backbone) - {'backbone', 'name', 'trainable', 'dtype'})}."
            )
    return config
