"""Checkpoint loaders and writers per backbone family: a family with its own checkpoint formats registers them.

``load_checkpoint`` uses the loader of the most specific registered class of
the model's backbone (as ``keras_mone.flops`` does with FLOP counters), and
the ViT loader (``load_vit_state``) for every backbone without one. MLP-Mixer
registers its own (``keras_mone.methods.mixer.checkpoints``)::

    @register_checkpoint_loader(MyBackbone)
    def _load(model, source, format, strict, name):
        ...  # read ``source`` in ``format``, load it, return the report

    @register_checkpoint_writer(MyBackbone, formats=("timm",), check=check_my_model)
    def _arrays(weights, backbone, format):
        ...  # {checkpoint key: weights.take(model path)} (``write_checkpoint``)
"""

from collections import namedtuple

_LOADERS = {}


def register_checkpoint_loader(backbone_class):
    """Decorator registering ``fn(model, source, format, strict, name) -> report`` for
    ``backbone_class`` and its sub-classes (unless they register their own)."""

    def decorator(fn):
        _LOADERS[backbone_class] = fn
        return fn

    return decorator


def _most_specific(table, model):
    """``table``'s entry for the nearest class in the MRO of ``model``'s backbone (or ``model``), or ``None``."""
    backbone = getattr(model, "backbone", model)
    return next((table[klass] for klass in type(backbone).__mro__ if klass in table), None)


def loader_for(model):
    """The registered loader for ``model``'s backbone (or ``model`` itself), or ``None``."""
    return _most_specific(_LOADERS, model)


#: A family's checkpoint writer: its ``formats``, ``check(model)`` (raises on a
#: model it cannot write) and ``arrays(weights, backbone, format) -> {key: array}``.
CheckpointWriter = namedtuple("CheckpointWriter", "name formats check arrays")
_WRITERS = {}


def register_checkpoint_writer(backbone_class, formats, check, name=None):
    """Decorator registering ``fn(weights, backbone, format) -> {key: array}`` as the
    ``write_checkpoint`` layout of ``backbone_class`` and its sub-classes, in
    ``formats``; ``check(model)`` runs first; ``name`` (the class's by default)
    names the family in errors."""

    def decorator(fn):
        _WRITERS[backbone_class] = CheckpointWriter(name or backbone_class.__name__, tuple(formats), check, fn)
        return fn

    return decorator


def writer_for(model):
    """The registered ``CheckpointWriter`` for ``model``'s backbone, or ``None`` (the ViT layout)."""
    return _most_specific(_WRITERS, model)


def registered_writers():
    """Every registered ``CheckpointWriter`` (for errors that list the formats of each family)."""
    return tuple(_WRITERS.values())
