"""Preset definitions of keras_mone (installed as ``keras_mone.zoo``).

Each ``*.toml`` file holds presets: a table per preset with a ``description``,
an ``architecture`` (see ``keras_mone.presets.ARCHITECTURES``), a ``variant``
from the size table (``"B/16"``) and any constructor arguments that differ from
the defaults. Presets with trained weights have them in ``weights/``: one
``<preset>.weights.h5`` each, listed with its sha256, recipe, command and test
accuracy in ``weights/manifest.toml`` (written by ``keras-mone presets publish``;
format in ``keras_mone.presets.weights``).
"""
