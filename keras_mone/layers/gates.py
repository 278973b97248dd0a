"""Residual gates: how a routed block mixes a router's score into its update.

A gate is the block part that differs between routing methods. It declares
the parameters it needs (created on, and owned by, the block, so weight
files keep one layout whatever the gate) and applies a token's gate value
``g`` (its router score, one per token of a group) at one of two points:

* ``scale_mlp``: on the MLP update before the residual sum.
  MoNE (Eq. 1): ``x' = z + (alpha g + 1) FFN(LN2(z))``, ``alpha`` learnable
  in ``[0, 1)``, starting at ``alpha_init``.
* ``scale_block``: on the whole block update.
  Mixture-of-Depths: ``x' = x + g (block(x) - x)``, the router score ``g``
  multiplying everything the block adds.

A token group without gate values (``None``) is never scaled, so a routed
block run without a router (capacity 1.0) is the plain block.
"""

import keras
from keras import ops

from keras_mone.layers.config import register

# Largest value below 1 in each float type (1 - 1e-6 would round to 1 in 16 bits).
_BELOW_ONE = {"float16": 1.0 - 2.0**-11, "bfloat16": 1.0 - 2.0**-8}


@register
class HalfOpenUnitInterval(keras.constraints.Constraint):
    """Clips a weight into ``[0, 1)`` (MoNE's alpha, Sec. 4.1), in its own dtype."""

    def __call__(self, w):
        upper = _BELOW_ONE.get(keras.backend.standardize_dtype(w.dtype), 1.0 - 2.0**-24)
        return ops.clip(w, 0.0, upper)


class Gate:
    """No gating: the block's update is added unchanged (dense blocks, A-MoD)."""

    name = None

    def create_variables(self, block, alpha_init=0.0):
        """Adds the gate's parameters to ``block``; returns ``alpha`` (or ``None``)."""
        return None

    def mlp_scale(self, gate, alpha):
        """The per-token factor on the MLP update, ``(batch, k)``, or ``None`` (unscaled)."""
        return None

    def scale_mlp(self, update, gate, alpha):
        return update

    def scale_block(self, inputs, outputs, gate):
        return outputs


class NestedExpertGate(Gate):
    """MoNE, Eq. 1: the MLP update times ``alpha * g + 1`` (``alpha`` in ``[0, 1)``)."""

    name = "mone"

    def create_variables(self, block, alpha_init=0.0):
        return block.add_weight(
            name="alpha", shape=(), initializer=keras.initializers.Constant(alpha_init),
            constraint=HalfOpenUnitInterval(),
        )

    def mlp_scale(self, gate, alpha):
        return None if gate is None else ops.cast(alpha, gate.dtype) * gate + 1.0

    def scale_mlp(self, update, gate, alpha):
        scale = self.mlp_scale(gate, alpha)
        return update if scale is None else update * ops.cast(ops.expand_dims(scale, -1), update.dtype)


class RouterScoreGate(Gate):
    """Mixture-of-Depths: the block's whole update times the router score ``g``."""

    name = "score"

    def scale_block(self, inputs, outputs, gate):
        if gate is None:
            return outputs
        update = outputs - inputs
        return inputs + update * ops.expand_dims(ops.cast(gate, update.dtype), -1)


GATES = {gate.name: gate for gate in (Gate(), NestedExpertGate(), RouterScoreGate())}
"""Gate of each name a block accepts (``None``: no gate)."""


def get_gate(name):
    """The ``Gate`` called ``name``; a clear error for anything else."""
    if name not in GATES:
        raise ValueError(f"`gate` must be one of {list(GATES)}, got {name!r}.")
    return GATES[name]
