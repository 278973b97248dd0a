"""Picks an installed Keras backend when none is configured (runs before Keras is imported).

Keras falls back to tensorflow when neither ``KERAS_BACKEND`` nor
``keras.json`` names a backend, and then fails on import if tensorflow is not
installed (for example after ``pip install "keras-mone[jax]"``). keras_mone
keeps an explicit choice as it is; otherwise, if the configured or default
backend is missing, it uses the first installed of jax, torch and tensorflow,
or raises naming the extras to install. It says so only when someone chose
the missing backend: a ``keras.json`` that is Keras' own default (Keras writes
``"backend": "tensorflow"`` there on its first import, whatever is installed)
counts as no choice, like no file at all.
"""

import importlib.util
import json
import os
import sys
import warnings

PREFERENCE = ("jax", "torch", "tensorflow")
#: the ``keras.json`` Keras writes on its first import when there is none
KERAS_DEFAULT_CONFIG = {"floatx": "float32", "epsilon": 1e-07, "backend": "tensorflow", "image_data_format": "channels_last"}


def configured_backend():
    """``(backend, source)``: from ``KERAS_BACKEND``, ``keras.json`` or Keras' default
    (``"default"``: no file, or the file Keras writes itself)."""
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"], "KERAS_BACKEND"
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as file:
            config = json.load(file)
        backend = config.get("backend")
        if backend and config != KERAS_DEFAULT_CONFIG:
            return backend, "keras.json"
    except (OSError, ValueError, AttributeError):
        pass
    return "tensorflow", "default"


def is_installed(backend):
    if backend == "numpy":
        return True
    try:
        return importlib.util.find_spec(backend) is not None
    except (ImportError, ValueError):
        return False


def choose_backend():
    """Sets ``KERAS_BACKEND`` to an installed backend if the configured one is missing."""
    if "keras" in sys.modules:
        return  # too late to choose: Keras has already picked its backend
    backend, source = configured_backend()
    if source == "KERAS_BACKEND" or is_installed(backend):
        return
    installed = [name for name in PREFERENCE if is_installed(name)]
    if not installed:
        raise ImportError(
            f"Keras' backend {backend!r} ({source}) is not installed, nor is any other: "
            'install one, e.g. pip install "keras-mone[jax]" (or [torch], [tensorflow]).'
        )
    os.environ["KERAS_BACKEND"] = installed[0]
    if source == "default":  # nobody chose the missing one: nothing to say
        return
    warnings.warn(
        f"Keras' backend {backend!r} ({source}) is not installed; keras_mone uses "
        f"{installed[0]!r}. Set KERAS_BACKEND to choose.",
        stacklevel=3,
    )
