"""Preset definitions of keras_mone (installed as ``keras_mone.zoo``).

Each ``*.toml`` file holds presets: a table per preset with a ``description``,
an ``architecture`` (see ``keras_mone.presets.ARCHITECTURES``), a ``variant``
from the size table (``"B/16"``), any constructor arguments that differ from
the defaults, and, once published, a ``weights`` manifest entry.
"""
