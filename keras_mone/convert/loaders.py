"""Checkpoint loaders per backbone family: a family with its own checkpoint formats registers one.

``load_checkpoint`` uses the loader of the most specific registered class of
the model's backbone (as ``keras_mone.flops`` does with FLOP counters), and
the ViT loader (``load_vit_state``) for every backbone without one. MLP-Mixer
registers its own (``keras_mone.convert.mixer``)::

    @register_checkpoint_loader(MyBackbone)
    def _load(model, source, format, strict, name):
        ...  # read ``source`` in ``format``, load it, return the report
"""

_LOADERS = {}


def register_checkpoint_loader(backbone_class):
    """Decorator registering ``fn(model, source, format, strict, name) -> report`` for
    ``backbone_class`` and its sub-classes (unless they register their own)."""

    def decorator(fn):
        _LOADERS[backbone_class] = fn
        return fn

    return decorator


def loader_for(model):
    """The registered loader for ``model``'s backbone (or ``model`` itself), or ``None``."""
    backbone = getattr(model, "backbone", model)
    for klass in type(backbone).__mro__:
        if klass in _LOADERS:
            return _LOADERS[klass]
    return None
