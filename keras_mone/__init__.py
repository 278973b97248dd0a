"""keras_mone: a Keras 3 model zoo for conditional-computation vision models.

Mixture of Nested Experts (Jain et al., NeurIPS 2024) and the dense ViTs it
builds on, on the jax, tensorflow and torch backends.
"""

import importlib.util as _importlib_util
import os as _os
import sys as _sys

from keras_mone.backend_choice import choose_backend
from keras_mone.host_memory import restart_command_with_huge_pages


def _checkout_data_packages():
    """Run from a source checkout (``PYTHONPATH``, not installed, as ``bench/gpu.sh`` does on a
    bare GPU machine), ``zoo/`` and ``recipes/`` beside the package stand in for
    ``keras_mone.zoo`` and ``keras_mone.recipe_files``, which an install maps them to
    (pyproject's ``package-dir``)."""
    root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    for name, folder in (("keras_mone.zoo", "zoo"), ("keras_mone.recipe_files", "recipes")):
        init = _os.path.join(root, folder, "__init__.py")
        if name in _sys.modules or not _os.path.isfile(init) or _importlib_util.find_spec(name) is not None:
            continue
        spec = _importlib_util.spec_from_file_location(name, init, submodule_search_locations=[_os.path.dirname(init)])
        module = _importlib_util.module_from_spec(spec)
        _sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del _sys.modules[name]  # no half-initialised module left behind
            raise
        globals()[name.rsplit(".", 1)[1]] = module  # as an import of the submodule would set it


_checkout_data_packages()

restart_command_with_huge_pages()  # the keras-mone command only (keras_mone.host_memory)
choose_backend()

# The command has restarted and the backend is chosen before anything imports Keras.
from keras_mone import analysis, convert, data, layers, methods, models, presets, routing, training  # noqa: E402
from keras_mone.analysis import flops  # noqa: E402
from keras_mone.version import __version__  # noqa: E402

__all__ = [
    "__version__",
    "analysis",
    "convert",
    "data",
    "flops",
    "layers",
    "methods",
    "models",
    "presets",
    "routing",
    "training",
]
