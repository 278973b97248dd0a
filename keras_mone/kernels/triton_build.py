"""How the torch backend's Triton kernels are built (``triton_nested_mlp``, ``triton_grouped_tile``,
``triton_row_statistics``): for a launch, compiled by ``triton.jit`` or run by Triton's
interpreter (any device: how CI tests them), and compiled for a CUDA card without one (the code
``bench/kernel_compile.py`` reads registers and spills from). Triton is imported when called.
"""

import functools
import types


@functools.cache
def jitted(function, interpret):
    """The Triton kernel of ``function``: ``triton.jit``, or Triton's interpreter (which runs the
    ``@triton.jit`` helpers of ``function``'s module as Python: ``python_helpers``)."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(python_helpers(function))
    import triton

    return triton.jit(function)


def exact_float32(dtype):
    """Whether float32 matmuls of ``dtype`` rows run without TF32 (torch's setting: the legacy
    ``allow_tf32``, which dynamo traces without a graph break, or, where the new
    ``fp32_precision`` API was used and the legacy read raises, that one): the kernels' "ieee" dot."""
    import torch

    if dtype != torch.float32:
        return False
    try:
        return not torch.backends.cuda.matmul.allow_tf32
    except RuntimeError:  # torch refuses the legacy read once the new API set the precision
        return torch.backends.cuda.matmul.fp32_precision != "tf32"


def python_helpers(function):
    """``function`` with the ``@triton.jit`` helpers of its module's globals read as their Python
    functions: a ``JITFunction`` refuses calls outside a compiled kernel, and Triton's interpreter
    chosen after Triton was imported (``InterpretedFunction``) runs a kernel as Python."""
    from triton.runtime.jit import JITFunction

    namespace = dict(function.__globals__)
    for name, value in function.__globals__.items():
        if isinstance(value, JITFunction):
            namespace[name] = types.FunctionType(value.fn.__code__, namespace, value.fn.__name__, value.fn.__defaults__)
    return types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__)


def compile_for_cuda(function, signature, constants, options, capability=90):
    """``function`` compiled by Triton for a CUDA card of compute ``capability`` (90: H100/H200)
    without one: Triton's ``CompiledKernel`` (``.asm["ptx"]``, ``.metadata.shared``).
    ``signature``: Triton's type of each runtime argument by name ("*bf16", "i32", ...);
    ``constants``: the compile-time arguments; ``options``: ``num_warps``, ``num_stages``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = jitted(function, False)
    signature = {**signature, **{name: "constexpr" for name in constants}}
    constexprs = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    return triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", capability, 32),
                          options=options)
