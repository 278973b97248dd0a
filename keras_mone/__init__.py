"""keras_mone: a Keras 3 model zoo for conditional-computation vision models.

Mixture of Nested Experts (Jain et al., NeurIPS 2024) and the dense ViTs it
builds on, on the jax, tensorflow and torch backends.
"""

from keras_mone.backend_choice import choose_backend
from keras_mone.host_memory import restart_command_with_huge_pages

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
