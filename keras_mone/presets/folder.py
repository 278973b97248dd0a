"""Preset folders, keras-hub's convention: ``config.json``, ``model.weights.h5``, ``metadata.json``.

``save_to_preset(model, path)`` writes one (atomically: into a sibling
temporary folder, renamed at the end; only into a new or empty folder or
over a preset folder with ``overwrite=True``); ``load_preset_folder(path)`` checks
every file's sha256 against ``metadata.json`` before Keras reads it, builds
the model from ``config.json`` and loads the weights only if every variable's
shape fits (``SafeLoadingMixin``), so a folder whose config and weights
disagree fails naming the mismatched shapes, and nothing half-loads.
"""

import errno
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


PRESET_FILES = (CONFIG_FILE, WEIGHTS_FILE, METADATA_FILE)


def save_to_preset(model, path, overwrite=False, weights_source="keras_mone", license="Apache-2.0",
                   accuracy=None, **extra):
    """Writes ``model`` as a preset folder at ``path``.

    ``path`` must be new, empty, or a preset folder written by
    ``save_to_preset`` (replaced only with ``overwrite=True``; files in it
    that are not preset files stay). The preset is written into a temporary
    sibling folder and renamed into place, so a failure leaves ``path`` as it
    was. New folders get the umask's permissions. A ``PermissionError``
    names ``path`` when its parent folder is not writable.

    Args:
        model: a built keras_mone classifier or backbone.
        path: the folder to write.
        overwrite: replace an existing preset folder at ``path``.
        weights_source: where the weights come from (a checkpoint URL, a recipe, ...).
        license: the weights' licence.
        accuracy: optional ``{setting: top-1}`` to record.
        **extra: more metadata entries (JSON-serialisable).

    Returns:
        The metadata written.
    """
    path = os.path.abspath(os.fspath(path))
    replacing = _check_target(path, overwrite)
    staging = _staging_folder(path)
    try:
        os.chmod(staging, os.stat(path).st_mode & 0o7777 if os.path.isdir(path) else 0o777 & ~_umask())
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
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # only files this call wrote
        raise
    publish_folder(staging, path, replacing)
    return metadata


def _staging_folder(path):
    """A new temporary folder beside ``path``; a ``PermissionError`` naming ``path`` if it cannot be written."""
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, exist_ok=True)
        return tempfile.mkdtemp(prefix=".preset-", dir=parent)
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise PermissionError(
            error.errno,
            f"save_to_preset: cannot write the preset folder {path!r}: its parent folder {parent!r} is not "
            f"writable ({error.strerror}); nothing was written. Pass a folder in a writable place.",
        ) from error


def _umask():
    try:  # Linux: read it without changing it (os.umask would, briefly, for every thread)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def _check_target(path, overwrite):
    """``True`` if ``path`` is a preset folder to replace; raises if ``path`` may not be written."""
    if not os.path.lexists(path):
        return False
    if not os.path.isdir(path) or os.path.islink(path):
        raise ValueError(
            f"save_to_preset: {path!r} exists and is not a folder (or is a symbolic link); pass a new or empty folder."
        )
    entries = os.listdir(path)
    if not entries:
        return False
    if not is_saved_preset(path):
        raise ValueError(
            f"save_to_preset: folder {path!r} is not empty and is not a preset folder "
            f"(it holds {sorted(entries)[:5]}{' ...' if len(entries) > 5 else ''}); nothing was written. "
            "Pass a new or empty folder."
        )
    if not overwrite:
        raise ValueError(
            f"save_to_preset: folder {path!r} already holds a preset; pass overwrite=True to replace it."
        )
    return True


def is_saved_preset(path):
    """Whether ``path`` holds a preset written by ``save_to_preset`` (``metadata.json`` with sha256s, ``config.json``)."""
    try:
        with open(os.path.join(path, METADATA_FILE)) as f:
            hashes = json.load(f).get("sha256")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(hashes, dict) and os.path.isfile(os.path.join(path, CONFIG_FILE))


def publish_folder(staging, path, replacing):
    """Renames the finished ``staging`` folder to ``path``.

    A preset folder at ``path`` (``replacing``) is moved aside first; then
    its preset files are removed and anything else in it is moved into the
    new folder. An empty folder at ``path`` is replaced.
    """
    aside = None
    try:
        if replacing:
            aside = tempfile.mkdtemp(prefix=".replaced-", dir=os.path.dirname(path))
            os.rmdir(aside)
            os.rename(path, aside)
        elif os.path.isdir(path):
            os.rmdir(path)  # empty: raises (nothing lost) if a file appeared meanwhile
        os.rename(staging, path)
    except BaseException:
        if aside and os.path.isdir(aside) and not os.path.exists(path):
            os.rename(aside, path)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if aside:
        for name in os.listdir(aside):
            if name in PRESET_FILES:
                os.remove(os.path.join(aside, name))
            elif not os.path.lexists(os.path.join(path, name)):
                os.rename(os.path.join(aside, name), os.path.join(path, name))
        if not os.listdir(aside):
            os.rmdir(aside)


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


def load_preset_folder(path, load_weights=True, sha256=None, **overrides):
    """The model saved in preset folder ``path``.

    ``sha256`` (optional) pins the folder's ``metadata.json``. ``overrides``
    replace entries of the saved configuration (the classifier's or its
    backbone's, e.g. ``capacity``); an argument that changes a weight shape
    then fails the weights check with the shapes named.
    """
    path = os.fspath(path)
    if sha256 is not None:
        actual = sha256_of(os.path.join(path, METADATA_FILE)) if os.path.isfile(os.path.join(path, METADATA_FILE)) else None
        if actual != sha256:
            raise ValueError(
                f"{METADATA_FILE} of preset folder {path!r} has sha256 {actual}, but sha256={sha256!r} was "
                "passed: the folder is not the pinned preset."
            )
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
