"""A ``ViTBlock`` over token groups with each nested projection one kernel launch (jax).

With ``$KERAS_MONE_PROJECTIONS=grouped_kernel`` (``platform_forms.projections_form``) a block
joins its token groups along the tokens once and runs each of its four nested projections
as one ``kernels.grouped_projection`` launch over all groups, in place of one GEMM per
group (MoNE App. A.1 Eq. 5-7)::

    x   = [x_1, ..., x_E]                              (batch, tokens, D)
    q, k, v = Proj_in(LN1(x))                           each group's rows read x[:, :d_j]
    z   = x + Proj_out(SA(q, k, v))                     each group writes its first d_j features
    x'  = z + (alpha g + 1) Proj_out(GELU(Proj_in(LN2(z))))     (Eq. 1; the gate "mone")

fc1's bias and GELU, both residual adds and the gate are the kernels' epilogues, and both
LayerNorms the in-projections' prologues (their row statistics computed beforehand, once over
all groups: ``layers.layer_norm.row_statistics``): no separate pass over the hidden
activations, the normalised tokens or the residual stream. In the one-pass statistics form
(``platform_forms.statistics_form``, jax's GPU default) each out-projection's programs sum the
rows they write (``statistics_epsilon``, ``kernels.row_sums``) and the next in-projection's
prologue finishes the statistics from those sums: the attention's for the second LayerNorm,
fc2's for the next kernel block's first where that block's groups are fc2's very outputs. No
reduction reads the stream between the kernels (inference calls). Under a trace an inference
call's out-projections write into their residual's buffer only their groups' column tiles
(``grouped_projection``'s ``in_place``): past a group's width the stream is neither read nor
written. Attention runs in the platform's fused form.
The outputs are the groups again, cut from one tensor; a next kernel block given those very
groups reads that tensor again (under a trace), so no split and join of the stream or of its
cotangent runs between kernel blocks. Blocks the kernels do not cover take
the generic path: parts of other classes than ``MoNEAttention`` and ``NestedMLP``, attention
without biases, the "score" gate, attention weights asked for, groups all at full width
(but under ``grouped_kernel_all``: a dense ViT's blocks in MoNE's fused form), widths ``D`` or
``mlp_dim`` that are not multiples of 16 (``shape_fits``), models under a
Keras distribution, and training calls of blocks with dropout.

Training calls (``training=True``, without dropout): fc1's epilogue writes its pre-activations
and their GELU (``keep_pre_activation``), fc2 reads the GELU's output forward and the
pre-activations backward (``input_activation``, ``activated``). The out-projections keep their
epilogues (residual adds, MoNE's gate, and one-pass the next LayerNorms' row sums, finished by
XLA so that autodiff reaches them) unless the block has stochastic depth, where XLA applies
them. Each kernel's backward pass is grouped kernels too (``kernels.grouped_gradients``: dX by
the transposed weights, fc2's with the GELU's derivative in its epilogue; dW and db by one
weight-gradient launch; the gate's gradient summed by fc2's dX kernel, in its epilogue). Only
an inference call's fc1 (its GELU in the epilogue) or a prologue finishing row sums make the
backward pass recompute the per-group path (``jax.grad`` outside training; exact).
"""

import weakref

import keras
import numpy as np
from keras import ops

from keras_mone.layers.attention import MoNEAttention, multi_head_attention
from keras_mone.layers.layer_norm import normalize, prologue_applies, row_statistics
from keras_mone.layers.mlp import NestedMLP, _kernel_gelu
from keras_mone.layers.platform_forms import (
    accelerator, attention_form, fused_attention, kernel_covers, statistics_form,
)
from keras_mone.layers.stored_weights import stored


def kernel_block_applies(block, groups, widths, gates, training=None, return_received_attention=False):
    """Whether ``block`` runs ``groups`` through ``kernel_block`` (see the module docstring)."""
    if return_received_attention or keras.backend.backend() != "jax":
        return False  # (torch's grouped kernel is its packed blocks': ``layers.packed_kernels``)
    if not kernel_covers(widths, block.hidden_dim):  # per_group, or nothing nested: the block's GEMMs
        return False
    if type(block.attention) is not MoNEAttention or type(block.mlp) is not NestedMLP:
        return False
    from keras_mone.kernels.grouped_projection import shape_fits  # (jax: only where the form is asked for)

    if not shape_fits(block.hidden_dim, block.mlp.mlp_dim) or keras.distribution.distribution() is not None:
        return False  # (a sharded model: XLA's GEMMs, which the distribution's layouts reach)
    if block.gate not in (None, "mone") or not block.attention.use_bias:
        return False
    if training and (block.attention.dropout.rate or block.mlp.dropout.rate):  # (the parts' own rates: a block
        return False  # given its parts may hold rates its dropout_rate does not say; dropout: XLA's path)
    return not any(isinstance(g, keras.KerasTensor) for g in groups)


def kernel_block(block, groups, widths, gates=None, training=False):
    """``block``'s outputs for token ``groups`` (``(batch, k_j, D)`` each) at ``widths``,
    gated by ``gates`` (``None`` or one ``(batch, k_j)`` tensor or ``None`` per group):
    ``(batch, k_j, D)`` each, as the generic path gives them. ``training``: fc1 keeping its
    pre-activations, so that every kernel's backward pass is grouped kernels too
    (``kernels.grouped_gradients``), and the out-projections' epilogues by XLA where the block has
    stochastic depth. In the one-pass statistics form fc2's row sums go to the next kernel block
    (see the module docstring)."""
    import jax

    from keras_mone.kernels.grouped_projection import grouped_projection

    dtype = block.compute_dtype
    interpret = accelerator() != "gpu"
    layout = tuple((g.shape[1], w) for g, w in zip(groups, widths))
    entry = _carried_entry(groups)  # groups that are the previous kernel block's outputs: its joined stream
    if entry is not None and entry.joined is not None and entry.joined.dtype == dtype:
        stream = entry.joined  # (no split and join of the stream's cotangent between the blocks in training)
    else:
        stream = ops.cast(groups[0] if len(groups) == 1 else ops.concatenate(groups, axis=1), dtype)
    batch, tokens = stream.shape[0], stream.shape[1]
    attention, mlp = block.attention, block.mlp
    mlp_gelu = _kernel_gelu(mlp.gelu_approximate)  # float32 arithmetic, the result in the compute dtype
    in_kernel = _epilogue_in_kernel(block, training)

    def project(layer, x, side, residual=None, scale=None, **options):
        kernel, bias, x = stored(layer.kernel), stored(layer.bias), ops.cast(x, dtype)
        if in_kernel:  # (training: its gradients grouped too, kernels.grouped_projection)
            return grouped_projection(x, kernel, bias, layout, side, residual=residual, scale=scale,
                                      interpret=interpret, **options)
        out = grouped_projection(x, kernel, bias, layout, side, interpret=interpret, **options)
        return _epilogue(out, residual, scale, block)

    def normalized_projection(norm, layer, x, statistics=None, **epilogue):  # the LayerNorm as the prologue
        prologue = _prologue(norm, x, statistics)
        return project(layer, x if prologue else normalize(norm, x), "in", norm=prologue, **epilogue)

    heads = (batch, tokens, attention.num_heads, block.hidden_dim // attention.num_heads)
    # q, k and v written apart by the kernel: the fused attention reads them without a split copy
    carried = _carried_statistics(entry, block.norm1, stream)  # the previous fc2's sums
    # (training: finished by XLA, so that autodiff reaches the stream as their rows; inference: in the prologue)
    carried = carried.statistics() if training and carried is not None else carried
    query, key, value = (ops.reshape(t, heads) for t in normalized_projection(block.norm1, attention.qkv, stream,
                                                                               statistics=carried, parts=3))
    if attention_form() != "explicit":  # fused or flash
        attended = fused_attention(query, key, value)
    else:  # the platform's explicit form (the CPU's)
        attended = multi_head_attention(ops.stack([query, key, value], axis=2))
    attended = ops.reshape(attended, (batch, tokens, block.hidden_dim))
    # the second LayerNorm's one-pass statistics from the out-projection's row sums (``kernels.row_sums``)
    epsilon = _summing_epsilon(block.norm2, stream, in_kernel)
    # inference under a trace: each out-projection writes into its residual's buffer, only its groups' column tiles
    in_place = not training and isinstance(stream, jax.core.Tracer)  # (eagerly XLA would copy the call's argument)
    mid = project(attention.out, attended, "out", residual=stream, statistics_epsilon=epsilon, in_place=in_place,
                  residual_sums=carried)
    mid, mid_statistics = (mid, None) if epsilon is None else mid
    scale = _gate_scale(block, groups, gates, in_kernel)
    # the next block's first LayerNorm's sums, where it is this block's (checked there)
    epsilon = _summing_epsilon(block.norm1, stream, in_kernel)
    if training:  # fc1 stores its pre-activations and their GELU; fc2's backward pass applies the derivative
        # (the statistics finished by XLA, whose autodiff reaches mid as their rows: RowSums.statistics)
        mid_statistics = None if mid_statistics is None else mid_statistics.statistics()
        hidden, activated = normalized_projection(block.norm2, mlp.fc1, mid, statistics=mid_statistics,
                                                  activation=mlp_gelu, keep_pre_activation=True)
        outputs = project(mlp.fc2, hidden, "out", residual=mid, scale=scale, input_activation=mlp_gelu,
                          activated=activated, statistics_epsilon=epsilon)
    else:
        hidden = normalized_projection(block.norm2, mlp.fc1, mid, statistics=mid_statistics, activation=mlp_gelu)
        outputs = project(mlp.fc2, hidden, "out", residual=mid, scale=scale, statistics_epsilon=epsilon,
                          in_place=in_place, residual_sums=mid_statistics)
    outputs, statistics = (outputs, None) if epsilon is None else outputs
    ends = [int(end) for end in np.cumsum([g.shape[1] for g in groups])]
    pieces = [outputs[:, start:stop] for start, stop in zip([0, *ends[:-1]], ends)]
    _carry(pieces, outputs, statistics)
    return pieces


def _epilogue_in_kernel(block, training):
    """Whether the out-projections' epilogues (residual adds, MoNE's gate) are their kernels':
    always in inference; in training unless the block has stochastic depth (then XLA applies
    them, ``_epilogue``). Their gradients are grouped kernels too (``kernels.grouped_projection``)."""
    return not training or not block.drop_path.rate


def _summing_epsilon(norm, x, in_kernel=True):
    """``norm``'s epsilon where an out-projection writing the input of ``norm`` (like ``x``)
    sums its rows for it: its epilogue in the kernel (``in_kernel``), the one-pass statistics
    form (jax's GPU default), a plain LayerNorm with both weights
    (``layers.layer_norm.prologue_applies``); else ``None``."""
    if not in_kernel or statistics_form() != "one_pass" or not prologue_applies(norm, x):
        return None
    return float(norm.epsilon)


_CARRIED = []
"""The last kernel block's outputs for the next kernel block: at most one ``_Carried``, dropped
when its first group is freed (the end of a trace, or of an eager call whose outputs the caller
does not keep) or when the next kernel block replaces it."""


class _Carried:
    """Weak references to a kernel block's output groups (``references``), their joined stream
    (``joined``, while traced; else ``None``) and fc2's ``RowSums`` without their rows
    (``statistics``, or ``None``). It holds nothing an output group is, or that holds one:
    eagerly the joined stream would be a second copy of the outputs, and an entry holding its
    first group would never be dropped (a single group is the joined stream itself)."""

    def __init__(self, pieces, joined, statistics):
        self.references = tuple(weakref.ref(piece) for piece in pieces)
        self.joined, self.statistics = joined, statistics
        self.finalizer = weakref.finalize(pieces[0], _forget, id(self))


def _carry(pieces, joined, statistics):
    if _CARRIED:  # the entry replaced: its finalizer (which holds nothing of it) goes too
        _CARRIED[0].finalizer.detach()
    _CARRIED.clear()
    import jax  # (kernel blocks run on jax only)

    if not isinstance(joined, jax.core.Tracer) or any(piece is joined for piece in pieces):
        joined = None  # (a single group is the stream already)
    if statistics is not None:  # the rows go: the next block gives its stream (_carried_statistics)
        statistics = statistics.with_rows(None)
    if joined is not None or statistics is not None:
        _CARRIED.append(_Carried(pieces, joined, statistics))


def _forget(entry_id):
    if _CARRIED and id(_CARRIED[0]) == entry_id:
        _CARRIED.clear()


def _carried_entry(groups):
    """The previous kernel block's ``_Carried`` where ``groups`` are its very outputs (the same
    objects, in order, so no regrouping or other op came between); else ``None``."""
    if not _CARRIED:
        return None
    references = _CARRIED[0].references
    if len(references) != len(groups) or any(ref() is not group for ref, group in zip(references, groups)):
        return None
    return _CARRIED[0]


def _carried_statistics(entry, norm, stream):
    """The ``RowSums`` of ``stream`` (the joined groups, their ``rows``) from the previous kernel
    block's fc2 (``entry``, ``_carried_entry``), in this block's dtype, where ``norm`` takes its
    statistics from them with the same epsilon (``_summing_epsilon``); else ``None``."""
    statistics = None if entry is None else entry.statistics
    if statistics is None or entry.references[0]().dtype != stream.dtype:
        return None
    if _summing_epsilon(norm, stream) != statistics.epsilon:
        return None
    # the rows the sums were taken of: the stream (the same values), whose cotangent reaches the groups
    return statistics.with_rows(stream)


def _epilogue(out, residual, scale, block):
    """The out-projections' epilogue by XLA (training with stochastic depth): ``residual +
    drop_path(factor * out)`` in the compute dtype, the factor from ``scale``'s ``(gate, alpha)``
    by the block's gate (``gates.NestedExpertGate.mlp_scale``), as the generic path computes it,
    so that autodiff reaches the gate. ``block.drop_path``: the block's stochastic depth, one draw
    per example for all its tokens (the generic path's draw over its groups: the same shape, so
    the same draws)."""
    if residual is None:
        return out
    if scale is not None:
        out = out * ops.cast(block._gate.mlp_scale(*scale), out.dtype)[..., None]
    return residual + block.drop_path(out, training=True)


def _prologue(norm, x, statistics=None):
    """``(mean, rstd, gamma, beta)`` of the LayerNorm ``norm`` on ``x`` for a kernel's prologue
    (``layers.layer_norm.row_statistics``: the statistics in the platform's form), or with given
    ``statistics``: a ``(mean, rstd)`` pair, or ``(statistics, gamma, beta)`` for a
    ``kernels.row_sums.RowSums`` of the kernel that wrote ``x`` (the prologue finishes it); or
    ``None`` where ``normalize`` runs it: a LayerNorm without both weights, or one that Keras
    must call."""
    if statistics is None and not prologue_applies(norm, x):
        return None
    weights = (stored(norm.gamma), stored(norm.beta))
    if statistics is None:
        return (*row_statistics(norm, x), *weights)
    return (*statistics, *weights) if isinstance(statistics, tuple) else (statistics, *weights)


def _gate_scale(block, groups, gates, in_kernel):
    """MoNE's gate per token for the out-projection's epilogue, ``(gate, alpha)``: the gates of all
    groups joined, ``(batch, tokens)`` (0 for an ungated group: a factor of 1), and the block's
    alpha; ``None`` where no group is gated or the block has no MoNE gate. The kernels compute
    ``alpha g + 1`` themselves (``kernels.grouped_kernel.gated_scale``): the joined gates are the
    same for every block after a router, so XLA computes them once, not a factor per block. Alpha
    as stored (float32; no cast per block under mixed precision, as the kernels read their
    weights) for the kernel's epilogue (``in_kernel``); else as the generic path reads it
    (``_epilogue``). Under mixed precision the two therefore differ by bf16 rounding of alpha
    and of the factor."""
    if block.gate != "mone" or gates is None or all(g is None for g in gates):
        return None
    dtype = next(g for g in gates if g is not None).dtype
    parts = [ops.zeros(group.shape[:2], dtype) if gate is None else gate for group, gate in zip(groups, gates)]
    alpha = stored(block.alpha) if in_kernel else block.alpha
    return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=1), alpha
