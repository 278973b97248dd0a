"""Weights and model files checked before anything is written into a model.

Keras' ``load_weights`` assigns variable by variable and fails at the first
mismatch, so a file from a model of another size leaves the model half
changed, and a file from a deeper model loads into a shallower one without a
word. ``SafeLoadingMixin.load_weights`` compares every stored variable's shape
with the model's first, and refuses the file (naming it and the difference)
before a single value is assigned. ``load_saved_model`` does the same service
for ``.keras`` archives, which Keras reports as "File not found" when they are
merely truncated or not a Keras file.
"""

import collections
import os
import zipfile

import h5py
import keras

_NOT_MODEL_STATE = ("optimizer",)  # top-level groups of a .weights.h5 that are not model variables
# Groups inside a model that are not its state: the frozen dense teacher of
# ACM's conversion phases, which keras_mone 0.1.0 saved beside each ACM
# module (``keras_mone.methods.acm.teacher``); their checkpoints still restore.
_NOT_MODEL_PARTS = ("_acm_teacher",)


def _outside_the_model(name):
    return any(part in _NOT_MODEL_PARTS for part in name.split("/"))


def stored_variable_shapes(path):
    """``[(path in the file, shape)]`` of the model variables in a ``.weights.h5`` file (optimizer state excluded)."""
    shapes = []
    try:
        with h5py.File(path, "r") as file:
            for key in file:
                if key in _NOT_MODEL_STATE:
                    continue
                item = file[key]
                if isinstance(item, h5py.Dataset):
                    shapes.append((key, tuple(item.shape)))
                else:
                    item.visititems(
                        lambda name, node, key=key: shapes.append((f"{key}/{name}", tuple(node.shape)))
                        if isinstance(node, h5py.Dataset) and not _outside_the_model(name) else None
                    )
    except OSError as error:
        raise ValueError(
            f"Weights file {path!r} is not a readable HDF5 file (truncated or corrupt): {error}"
        ) from error
    return shapes


def check_weights_file(model, path):
    """Raises a ``ValueError`` unless ``path`` holds exactly the model's variable shapes."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Weights file {path!r} does not exist.")
    in_file = stored_variable_shapes(path)
    stored = collections.Counter(shape for _, shape in in_file)
    expected = collections.Counter(tuple(variable.shape) for variable in model.weights)
    if stored == expected:
        return
    extra = stored - expected
    missing = expected - stored
    first = ""
    file_path = next((name for name, shape in in_file if shape in extra), None)
    variable = next((v for v in model.weights if tuple(v.shape) in missing), None)
    if file_path and variable is not None:
        first = (
            f"First mismatch: {file_path!r} {dict(in_file)[file_path]} in the file, "
            f"{variable.path!r} {tuple(variable.shape)} in the model. "
        )
    raise ValueError(
        f"Weights file {path!r} does not fit {model.name!r}: it stores {sum(stored.values())} "
        f"variables, the model has {sum(expected.values())}. {first}Shapes only in the file: "
        f"{_summary(sorted(extra.elements()))}; only in the model: {_summary(sorted(missing.elements()))}. "
        "Nothing was loaded; build the model with the configuration the weights were saved from "
        "(depth, hidden_dim, image_size, patch_size, num_classes, ...)."
    )


def _summary(shapes, limit=4):
    if not shapes:
        return "none"
    text = ", ".join(str(shape) for shape in shapes[:limit])
    return text + (f" and {len(shapes) - limit} more" if len(shapes) > limit else "")


class SafeLoadingMixin:
    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """``keras.Model.load_weights``; a ``.weights.h5`` file is checked first (shapes, count).

        Nothing is assigned unless every stored variable fits; pass
        ``skip_mismatch=True`` for Keras' own partial loading.
        """
        if not self.built:
            self.build()
        if str(filepath).endswith(".weights.h5") and not skip_mismatch:
            check_weights_file(self, filepath)
        return super().load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)


def load_saved_model(path, compile=False):
    """``keras.saving.load_model`` with clear errors for missing, truncated or foreign files.

    A file that exists but cannot be read (Keras says "File not found" for a
    truncated archive) raises a ``ValueError`` naming the file, the original
    error chained.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Model file {path!r} does not exist.")
    unreadable = (
        f"Model file {path!r} exists ({os.path.getsize(path)} bytes) but is not a readable .keras archive "
        "(corrupt, truncated or not a Keras file)"
    )
    if path.endswith(".keras"):
        try:
            with zipfile.ZipFile(path) as archive:
                broken = archive.testzip()
                names = set(archive.namelist())
        except (zipfile.BadZipFile, OSError, EOFError) as error:
            raise ValueError(f"{unreadable}: {error}") from error
        if broken is not None:
            raise ValueError(f"{unreadable}: member {broken!r} fails its CRC check.")
        if "config.json" not in names:
            raise ValueError(f"Model file {path!r} is a zip archive but not a .keras model (no config.json).")
    try:
        return keras.saving.load_model(path, compile=compile)
    except Exception as error:  # Keras' own message may say "File not found" for a file that exists
        raise ValueError(
            f"Model file {path!r} exists but could not be loaded as a .keras model (a truncated or corrupt "
            f"member, or a class that is not registered): {type(error).__name__}: {error}"
        ) from error
