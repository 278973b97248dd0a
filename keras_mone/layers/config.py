"""Serialization helpers shared by every keras_mone layer and model.

Each constructor argument is written once: it is stored on ``self`` under its
own name, and ``ConfigMixin.get_config`` reads the constructor's signature to
build the config, so the config and the constructor cannot drift apart.
"""

import inspect

import keras

PACKAGE = "keras_mone"


def register(cls):
    """Registers ``cls`` for ``.keras`` saving under the ``keras_mone`` package."""
    return keras.saving.register_keras_serializable(package=PACKAGE)(cls)


def register_old_name(cls, old_name):
    """Lets configs that name ``cls`` by its former name ``old_name`` load as ``cls``.

    Configs are still written under the registered (new) name.
    """
    keras.saving.get_custom_objects()[f"{PACKAGE}>{old_name}"] = cls


class ConfigMixin:
    """``get_config`` from the ``__init__`` signature (arguments stored as attributes)."""

    def get_config(self):
        config = super().get_config()
        for name in config_argument_names(type(self)):
            value = getattr(self, name)
            if isinstance(value, (keras.initializers.Initializer, keras.layers.Layer)):
                value = keras.saving.serialize_keras_object(value)
            elif isinstance(value, tuple):
                value = list(value)
            config[name] = value
        return config


def config_argument_names(cls):
    """Explicit ``__init__`` arguments of ``cls`` and of its keras_mone bases.

    A subclass that forwards ``**kwargs`` to its parent still gets the
    parent's arguments in its config. Classes outside keras_mone count when
    they derive from ``ConfigMixin`` (a plug-in method's backbone); Keras'
    own bases do not.
    """
    names = []
    for klass in cls.__mro__:
        ours = klass.__module__.startswith("keras_mone") or (klass is not ConfigMixin and issubclass(klass, ConfigMixin))
        if not ours or "__init__" not in vars(klass):
            continue
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.name == "self" or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            if p.name not in names:
                names.append(p.name)
    return names
