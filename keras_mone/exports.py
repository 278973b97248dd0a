"""Public names shown by a package that sits below the code defining them.

``keras_mone.models`` and ``keras_mone.layers`` are both the shared floors of
the library (the ViT, its block, nested dense ...) and the public namespace a
user imports from. A method family lives above them, in its own folder
(``keras_mone/methods/<family>/``), and cannot be imported by them without an
upward import. So a family *exports* its public names into those namespaces,
as keras-hub's ``@keras_hub_export("keras_hub.models.X")`` does, and the
namespace package resolves them on attribute access (PEP 562)::

    # keras_mone/methods/acm/backbone.py
    @export("keras_mone.models")
    class ACMViTBackbone(ViTBackbone): ...

    # keras_mone/models/__init__.py
    __getattr__, __dir__ = exported_names("keras_mone.models", globals())

``import keras_mone`` loads every family (``keras_mone.methods.families``), so
``keras_mone.models.ACMViTBackbone`` and ``from keras_mone.models import
ACMViTBackbone`` work as they did when the class lived in ``models/``. Library
code imports a family's names from its folder, never from a namespace.
"""

_NAMESPACES = {}


def export(*namespaces, name=None):
    """Decorator (or plain call) showing an object under ``namespaces`` (e.g. ``"keras_mone.models"``).

    ``name``: the public name, the object's ``__name__`` by default (give it
    for constants: ``export("keras_mone.models", name="MIXER_SIZES")(sizes)``).
    Returns the object unchanged. Exporting a different object under a taken
    name raises ``ValueError`` (two families claiming one public name)."""
    if not namespaces or not all(isinstance(n, str) and n.startswith("keras_mone") for n in namespaces):
        raise ValueError(f"`namespaces` must be one or more 'keras_mone...' module names, got {namespaces!r}.")

    def show(obj):
        public = name or obj.__name__
        for namespace in namespaces:
            table = _NAMESPACES.setdefault(namespace, {})
            if table.get(public, obj) is not obj:
                raise ValueError(f"{namespace}.{public} is already exported by {table[public]!r}.")
            table[public] = obj
        return obj

    return show


def exported(namespace):
    """``{name: object}`` exported into ``namespace`` so far (a copy)."""
    return dict(_NAMESPACES.get(namespace, {}))


def exported_names(namespace, module_globals):
    """``(__getattr__, __dir__)`` for the namespace package ``namespace``: exported
    names resolve as attributes and are listed by ``dir()``; the package's
    ``__all__`` keeps only its own names (``from ... import *`` does not load
    families' names)."""

    def __getattr__(name):
        table = _NAMESPACES.get(namespace, {})
        if name in table:
            return table[name]
        raise AttributeError(f"module {namespace!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(module_globals) | set(_NAMESPACES.get(namespace, {})))

    return __getattr__, __dir__
