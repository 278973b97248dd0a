"""The one list of the zoo's method families: the modules of ``keras_mone.methods``
whose import registers their methods (``registry.register_method``).

A new family is a module (or folder) here that registers its methods, and
its name in ``FAMILIES``; nothing else in the library changes
(docs/skeleton.md). Order sets the order of the registry's tables.
"""

import importlib

FAMILIES = ("dense", "mone", "matvit", "mod", "mixer", "acm")


def load_families():
    """Imports every family module once (each registers its methods on import):
    a bare name is a module of ``keras_mone.methods``, a dotted one any module
    (a plug-in's, or a test's)."""
    for family in FAMILIES:
        importlib.import_module(family if "." in family else f"keras_mone.methods.{family}")
