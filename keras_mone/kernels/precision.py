"""The precision of the Pallas kernels' products: what jax's ``default_matmul_precision`` asks.

XLA's GEMMs follow ``jax.default_matmul_precision`` by themselves; a Pallas kernel's
``jnp.dot`` does not: Pallas' Triton lowering takes TF32 for float32 operands unless the dot
names ``lax.Precision.HIGHEST`` (then IEEE float32, as on a V100, which has no TF32: MoNE
Table 1's regime). The kernels read the setting when they are traced, so that a program
compiled under ``"highest"`` computes every product, XLA's and the kernels', alike.
"""

import contextlib

import jax

HIGHEST_NAMES = ("highest", "float32", "precision.highest", "f32_f32_f32")
"""``jax_default_matmul_precision`` values meaning float32 products without TF32 (lower case;
the dot-algorithm preset ``F32_F32_F32`` included: jax's setting takes its name only)."""


def precision_name():
    """``"highest"`` or ``"default"``: the products jax's ``default_matmul_precision`` asks
    for now (a hashable name: the kernels' jitted entry points take it as a static argument)."""
    chosen = str(jax.config.jax_default_matmul_precision or "default").lower()
    return "highest" if chosen in HIGHEST_NAMES else "default"


def dot_precision(name):
    """The ``precision`` a kernel's ``jnp.dot`` takes for ``precision_name()``'s ``name``:
    ``lax.Precision.HIGHEST`` or ``None`` (TF32 for float32 operands, as XLA's default)."""
    if name not in ("highest", "default"):
        raise ValueError(f"`precision` must be 'highest' or 'default' (precision_name()), got {name!r}.")
    return jax.lax.Precision.HIGHEST if name == "highest" else None


def precision_context(name):
    """A context in which XLA's products take ``name``'s precision: the kernels' backward
    passes, which recompute the plain paths, trace in it (as their forward was traced)."""
    return jax.default_matmul_precision("highest") if dot_precision(name) is not None else contextlib.nullcontext()
