"""What a CUDA GPU would be given, computed without one: ``jax.export`` for the "cuda" platform.

Lowering for CUDA runs Pallas' Triton lowering, with the checks the interpreter does not
make (power-of-2 loads and stores, supported ops), and leaves one ``TRITON_CALL`` custom call
per kernel launch in the StableHLO. Used by the kernel tests (CI has no GPU) and by
``bench/kernel_compile.py``.
"""

import jax
from jax import export

TRITON_CALL = "__gpu$xla.gpu.triton"
"""The custom call a Pallas kernel lowered through Triton becomes."""


def lower_for_cuda(function, *arguments):
    """StableHLO text of ``jax.jit(function)(*arguments)`` lowered for a CUDA GPU.

    ``arguments``: arrays or ``jax.ShapeDtypeStruct``. Export's refusal of custom calls
    without a compatibility guarantee is lifted for ``TRITON_CALL`` only: the text is read
    here, never serialised."""
    allowed = [export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    return export.export(jax.jit(function), platforms=["cuda"], disabled_checks=allowed)(*arguments).mlir_module()
