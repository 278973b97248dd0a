"""A packed ``ViTBlock`` with each nested projection one Triton launch (torch).

With ``$KERAS_MONE_PROJECTIONS=grouped_kernel`` on torch (``platform_forms.projections_form``)
a packed block (``layers.packed_block``: the groups as one token-major ``(rows, D)`` tensor,
each a contiguous run of rows) runs q/k/v, the attention's out-projection, fc1 and fc2 each as
one ``kernels.triton_grouped_projection`` launch over all its groups, in place of one GEMM per
group and projection (MoNE App. A.1 Eq. 5-7)::

    qkv = Proj_in(LN1(x))                          each group's rows read x[:, :d_j]
    z   = x + Proj_out(SA(q, k, v))                each group writes its first d_j features
    x'  = z + (alpha g + 1) Proj_out(GELU(Proj_in(LN2(z))))     (Eq. 1; the gate "mone")

fc1's bias and GELU, the residual adds and the gate are the kernels' epilogues and both
LayerNorms the in-projections' prologues. Their statistics, at inference: the partials the
out-projection before wrote beside its output (``TilePartials``: the attention's for LN2, but
in float32 at torch's "highest" precision; for LN1, eagerly outside ``torch.inference_mode``,
the previous kernel block's fc2's, where this block's rows are that very output, unchanged).
Elsewhere (with autograd, and with ``$KERAS_MONE_STATISTICS=kernel``) each row's in one pass
beforehand (``kernels.triton_row_statistics``; torch's ops under ``torch.compile``). No pass of
its own over the hidden activations, the normalised tokens or the residual stream, no zero
padding, no concatenation
(q, k and v are strided views of one ``(rows, 3D)`` output, as torch's SDPA takes them), and no
copy of the attention's output (the out-projection reads it as SDPA wrote it: batch-major from
CUDA's memory-efficient kernel, float32's). The weights are read as stored
(``layers.stored_weights``): under mixed precision the kernel casts each float32 weight tile to
the rows' dtype as it loads it, the values Keras' autocast would give, without a cast copy of
every weight per call. Attention is torch's.

Blocks the kernel does not cover keep the per-group path: all groups at full width (dense's GEMMs;
but under ``grouped_kernel_all``), ``D`` or ``mlp_dim`` not a multiple of 16, rows that are not
float16, bfloat16 or float32, torch's autocast, TorchScript tracing and ``torch.func`` transforms
(``torch_eager.eager``). Gradients are the per-group path's, recomputed (the kernel's custom op).
Not timed on a card.
"""

import weakref

import keras

from keras_mone.kernels.triton_build import exact_float32
from keras_mone.layers.platform_forms import fused_attention, kernel_covers, statistics_form
from keras_mone.layers.stored_weights import stored
from keras_mone.layers.torch_eager import direct_layer_norm, eager, plain_layer_norm


def kernels_apply(block, rows, widths):
    """Whether the packed ``block`` runs token ``rows`` (``(tokens * batch, D)``) at ``widths``
    through ``kernel_halves`` (see the module docstring)."""
    if keras.backend.backend() != "torch" or not kernel_covers(widths, block.hidden_dim):
        return False  # per_group, or nothing nested under grouped_kernel: the block's GEMMs
    import torch

    from keras_mone.kernels.triton_grouped_projection import shape_fits

    if not (eager() or torch.compiler.is_compiling()):  # TorchScript tracing, torch.func: no kernel launches
        return False
    if not shape_fits(block.hidden_dim, block.mlp.mlp_dim):
        return False
    return not torch.is_autocast_enabled(rows.device.type) and rows.dtype in (torch.float16, torch.bfloat16,
                                                                               torch.float32)


def kernel_halves(block, rows, spans, widths, tokens, gate_rows=None):
    """``block``'s outputs for token-major ``rows`` (``tokens`` per image; each group the rows of
    its span, at its width), gated by ``gate_rows`` (``(rows,)`` or ``None``): ``(rows, D)``."""
    from keras_mone.kernels.triton_grouped_projection import grouped_projection

    attention, mlp = block.attention, block.mlp
    interpret = rows.device.type != "cuda"

    def project(layer, x, side, **epilogue):
        kernel, bias = (None if v is None else stored(v) for v in (layer.kernel, layer.bias))
        return grouped_projection(x, kernel, bias, spans, widths, side, interpret=interpret, **epilogue)

    def normalized_projection(norm, layer, x, partials, **epilogue):  # the LayerNorm as the prologue where it can
        prologue = _prologue(norm, x, interpret, partials)
        return project(layer, x if prologue else direct_layer_norm(norm, x), "in", norm=prologue, **epilogue)

    import torch

    dim, heads = block.hidden_dim, attention.num_heads
    # partials at inference (with autograd the op's would be torch's ops, a pass of their own); from one block
    # to the next only eagerly (the carry checks the rows' storage and version counter, neither of which
    # torch.compile's tracing reads) and outside inference_mode (whose tensors keep no version counter)
    carry = not torch.is_grad_enabled() and statistics_form() != "kernel"
    between_blocks = carry and not torch.compiler.is_compiling() and not torch.is_inference_mode_enabled()
    # float32 at torch's "highest" precision (no tensor cores): fc1 from partials spills in its loop on sm_90
    # (BENCHMARKS.md, "torch: each LayerNorm's statistics ..."), so LN2 keeps the statistics kernel there
    ln2_partials = carry and not exact_float32(rows.dtype)
    qkv = normalized_projection(block.norm1, attention.qkv, rows,
                                _carried_partials(rows) if between_blocks else None)
    # (tokens, batch, 3, heads, head_dim) -> (3, batch, heads, tokens, head_dim): views, no copy
    qkv = qkv.view(tokens, -1, 3, heads, dim // heads).permute(2, 1, 3, 0, 4)
    # (batch, heads, tokens, head_dim) -> (tokens, batch, D), a view: token-major memory (flash, cuDNN, the CPU) or
    # batch-major (CUDA's memory-efficient SDPA, float32's), which the kernel reads through its strides
    attended = fused_attention(qkv[0], qkv[1], qkv[2], heads_first=True).permute(2, 0, 1, 3).flatten(2)
    z, partials = _with_statistics(project(attention.out, attended, "out", residual=rows, statistics=ln2_partials))
    activation = "gelu_tanh" if mlp.gelu_approximate else "gelu"
    hidden = normalized_projection(block.norm2, mlp.fc1, z, partials, activation=activation)
    scale = None
    if gate_rows is not None:  # MoNE's alpha g + 1 by the kernel (no ops of its own per block), else the gate's
        mone = block.gate == "mone"
        scale = (gate_rows, stored(block.alpha)) if mone else block._gate.mlp_scale(gate_rows, block.alpha)
    outputs, partials = _with_statistics(project(mlp.fc2, hidden, "out", residual=z, scale=scale,
                                                 statistics=between_blocks))
    if between_blocks:
        _remember(outputs, partials)
    return outputs


def _prologue(layer, rows, interpret, partials=None):
    """``(mean, rstd, gamma, beta)`` for a kernel's LayerNorm prologue (``(partials, epsilon, gamma,
    beta)`` given ``partials``, the rows' ``TilePartials``), or ``None`` where the layer runs itself
    (``torch_eager.direct_layer_norm``): a plain LayerNorm (``torch_eager.plain_layer_norm``) with
    both weights. Statistics: ``kernels.triton_row_statistics``."""
    if not plain_layer_norm(layer, rows.dim()) or layer.gamma is None or layer.beta is None:
        return None
    if partials is not None:
        return (partials, float(layer.epsilon), stored(layer.gamma), stored(layer.beta))
    from keras_mone.kernels.triton_row_statistics import row_statistics

    return (*row_statistics(rows, layer.epsilon, interpret), stored(layer.gamma), stored(layer.beta))


def _with_statistics(result):
    """``(out, partials or None)`` of a projection called with or without ``statistics``."""
    return result if isinstance(result, tuple) else (result, None)


class _Carried:
    """The last kernel block's output, as one tuple set and read in one step (threads running
    models at once each see a whole entry): a weak reference to the output, its version counter
    then, and its ``TilePartials``. The next block's LN1 takes the partials where its rows are that
    tensor, unchanged. Writes that bypass the version counter (``.data``, a numpy or DLPack view,
    another kernel writing into the buffer) are not seen; nothing in the zoo writes so."""

    entry = None


def _remember(output, partials):
    """Keep ``partials`` for the next block while ``output`` lives (an inference tensor keeps no
    version counter: nothing is kept)."""
    def forget(reference):
        entry = _Carried.entry
        if entry is not None and entry[0] is reference:
            _Carried.entry = None

    if not output.is_inference():
        _Carried.entry = (weakref.ref(output, forget), output._version, partials)


def _carried_partials(rows):
    """The remembered ``TilePartials`` if ``rows`` is the remembered output (the same storage,
    shape and strides, or a view of it that is all of it) and unchanged since (its version
    counter), else ``None``."""
    entry = _Carried.entry
    output = None if entry is None else entry[0]()
    if output is None or (rows if rows._base is None else rows._base) is not output:
        return None
    same = rows.data_ptr() == output.data_ptr() and rows.shape == output.shape and rows.stride() == output.stride()
    return entry[2] if same and output._version == entry[1] else None
