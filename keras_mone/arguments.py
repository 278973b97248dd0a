"""Checks of constructor arguments, run before anything is built.

Numbers must be numbers: ``True``, ``"88"`` or ``4.0`` is no int (a string
would otherwise be read character by character), numpy integers are ints, and
floats must be finite. Each error names the argument and what is allowed.
"""

import math
import numbers

import numpy as np


def integer(name, value, low=1):
    """``value`` as an ``int`` >= ``low``, or a ``ValueError`` naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")
    return int(value)


def number(name, value, low=None, high=None, low_open=False, high_open=False):
    """``value`` as a finite ``float`` within the bounds, or a ``ValueError`` naming ``name``."""
    interval = (
        ("(" if low_open else "[") + ("-inf" if low is None else f"{low:g}") + ", "
        + ("inf" if high is None else f"{high:g}") + (")" if high_open or high is None else "]")
    )
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number in {interval}, got {value!r}.")
    value = float(value)
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        raise ValueError(f"`{name}` must lie in {interval}, got {value!r}.")
    return value


def flag(name, value):
    """``value`` as a ``bool`` (``True`` or ``False``, or what equals them), or a ``ValueError``
    naming ``name``."""
    if value not in (True, False):
        raise ValueError(f"`{name}` must be True or False, got {value!r}.")
    return bool(value)


def transformer_size(hidden_dim, depth, num_heads, mlp_dim, num_channels=3):
    """Checks a transformer's sizes; returns them as ints."""
    hidden_dim, depth = integer("hidden_dim", hidden_dim), integer("depth", depth)
    num_heads, mlp_dim = integer("num_heads", num_heads), integer("mlp_dim", mlp_dim)
    num_channels = integer("num_channels", num_channels)
    if hidden_dim % num_heads:
        raise ValueError(f"`hidden_dim` ({hidden_dim}) must be divisible by `num_heads` ({num_heads}).")
    return hidden_dim, depth, num_heads, mlp_dim, num_channels


def regularisation(dropout_rate, drop_path_rate, layer_norm_epsilon):
    """Checks dropout, stochastic depth and LayerNorm epsilon."""
    return (
        number("dropout_rate", dropout_rate, 0.0, 1.0, high_open=True),
        number("drop_path_rate", drop_path_rate, 0.0, 1.0, high_open=True),
        number("layer_norm_epsilon", layer_norm_epsilon, 0.0, low_open=True),
    )
