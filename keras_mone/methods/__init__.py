"""The methods of the zoo and their registry (``registry.register_method``).

A method's registry entry names its architectures (backbone and task
classes), its training modes and how recipe keys configure it; presets,
recipes and the analyses read the registry. This package sits above
``models`` (the backbones and tasks it registers) and ``training`` (the
modes and losses a method trains with), so neither of those imports it.
ACM's entry, modes and loss terms are ``methods.acm``.
"""

from keras_mone.methods.registry import (
    ARCHITECTURE_MODES,
    ARCHITECTURES,
    MODE_NAMES,
    TASKS,
    Architecture,
    Method,
    architectures,
    method_of,
    mode_of,
    register_method,
)

__all__ = [
    "ARCHITECTURES", "ARCHITECTURE_MODES", "Architecture", "MODE_NAMES", "Method", "TASKS", "architectures",
    "method_of", "mode_of", "register_method",
]
