"""A nested projection over all of a block's token groups as one Pallas kernel (jax).

Why (issue 40). MoNE's nested projections (App. A.1 Eq. 5-7) run one GEMM per token group:
``x[:, :d] @ W[:d]`` for an in-projection, ``x @ W[:, :d]`` for an out-projection. With
E = 4 groups MoNE-ViT-B/16's forward launched 1039 kernels on an H200 against dense's 350,
and at batch 64 and for ViViT at batch 1, where each group's GEMM has a few hundred rows,
the launches and the small GEMMs cost more than the FLOPs saved (BENCHMARKS.md, "MoNE on an
H200, measured again"). Here one launch covers every group: a program takes ``block_rows``
rows of one group (gathered across the batch, so only a group's last tile is partly empty)
and ``block_cols`` output columns, and its loop over the contraction stops where its group's
weights stop:

* ``side="in"``: ``out[:, g] = act(LN(x)[:, g, :d_g] @ W[:d_g] + b)``, full output width ``N``
  (q/k/v, fc1; Eq. 5-6). The loop runs ``ceil(d_g / block_k)`` steps; ``act`` (e.g. the GELU)
  is applied in the epilogue, so fc1's output is written once, activated (in training also its
  pre-activations, which fc2's backward pass reads: ``keep_pre_activation``). With ``norm``, the
  block's LayerNorm is the prologue: each loaded tile is normalised with its rows' statistics
  (computed beforehand), so the normalised tokens are never written.
* ``side="out"``: ``out[:, g, :d_g] = x[:, g] @ W[:, :d_g] + b[:d_g]`` and zeros past
  ``d_g`` (Eq. 7's ``Pad``; the attention output, fc2). Column tiles past ``d_g`` skip the
  loop. Optional epilogue: ``residual + scale * out`` (the block's residual and MoNE's gate
  ``alpha g + 1``, Eq. 1), so the block's residual stream is written once per half; with
  ``statistics_epsilon``, also the next LayerNorm's statistics of the rows it writes, from
  each program's row sums (the stream is not read again for them).

``plain_grouped_projection`` is the same computation with XLA's ops, one GEMM per group:
the reference the kernel equals (float32 accumulation in both) and its backward pass, which
recomputes it from the saved inputs. ``interpret=True`` runs the kernel through Pallas'
interpreter (any platform: how CI tests it).
"""

import functools
import numbers

import jax
import jax.numpy as jnp

from keras_mone.kernels.grouped_gradients import gate_cotangents, projection_gradients
from keras_mone.kernels.grouped_kernel import (
    SIDES, TILES_ENV, check_tiles, checked_groups, default_tiles, gated_scale, in_place_fits, normalized,
    pallas_projection, shape_fits, tile_override,
)
from keras_mone.kernels.grouped_labels import kernel_label, labelled_cost
from keras_mone.kernels.precision import precision_context, precision_name
from keras_mone.kernels.row_sums import RowSums, plain_row_sums, with_statistics

__all__ = ["grouped_projection", "plain_grouped_projection", "SIDES", "TILES_ENV", "check_tiles", "checked_groups",
           "default_tiles", "kernel_label", "labelled_cost", "shape_fits", "tile_override"]
"""The kernel's tiles and checks (``kernels.grouped_kernel``) and labels (``kernels.grouped_labels``) are named
from here too."""


def plain_grouped_projection(x, w, b, groups, side, activation=None, residual=None, scale=None, parts=1, norm=None,
                             input_activation=None, keep_pre_activation=False, activated=None, statistics_epsilon=None,
                             statistics_tiles=1):
    """The grouped nested projection with XLA's ops, one GEMM per group (see the module docstring).

    Args:
        x: ``(batch, tokens, K)``: the token groups one after the other along the tokens.
        w, b: the full ``(K, N)`` kernel and ``(N,)`` bias, in any float dtype (mixed precision's
            float32 variables: the kernel casts each weight tile to ``x``'s dtype, so no cast
            copy of the weights is written first; the bias is added in float32).
        groups: ``((tokens, width), ...)`` per group, in token order; the tokens sum to ``x``'s.
        side: ``"in"`` (``width`` cuts ``w``'s rows) or ``"out"`` (its columns).
        activation: ``side="in"``: an elementwise function on the float32 pre-activation.
        residual, scale: ``side="out"``: ``(batch, tokens, N)`` and ``(batch, tokens)``; the
            result is ``residual + scale * projection``. ``scale`` may be a ``(gate, alpha)`` pair,
            a ``(batch, tokens)`` gate and a scalar: the factor is MoNE's ``alpha * gate + 1``
            (Eq. 1) in float32 (``gated_scale``; the kernel computes it in its epilogue).
        parts: ``side="in"``: the output columns cut into ``parts`` equal tensors (q, k and v
            of a fused q/k/v kernel: ``parts=3``), each written by the kernel apart, so that
            attention reads them without a copy.
        norm: ``side="in"``: ``(mean, rstd, gamma, beta)``, a LayerNorm applied to ``x`` first:
            ``((x - mean) * rstd * gamma + beta)`` in float32, rounded to ``x``'s dtype (as
            ``layers.layer_norm.normalize`` gives it); ``mean`` and ``rstd`` ``(batch, tokens)``,
            ``gamma`` and ``beta`` ``(K,)``. Or ``(RowSums, gamma, beta)``: the statistics as
            partial row sums of the kernel that wrote ``x`` (``kernels.row_sums``), which the
            prologue finishes per row.
        input_activation: ``side="out"``: an elementwise function (its result in ``x``'s dtype)
            applied to ``x`` first: fc2 of ``GELU(h)`` given ``h`` (the training form; its
            backward pass applies the derivative in the dX kernel's epilogue).
        keep_pre_activation: ``side="in"`` with an ``activation``, one part: return the
            pre-activations too, ``(pre, activation(pre))`` (fc1 of the training form; see
            ``grouped_projection``).
        activated: with ``input_activation``: ``input_activation(x)`` as computed beforehand
            (fc1's second output), whose values are used in its place; its cotangent is zero,
            the gradient reaches ``x`` through the activation's derivative.
        statistics_epsilon: ``side="out"``: also return the output rows' sums and sums of
            squares of the stored values, a ``kernels.row_sums.RowSums`` for a LayerNorm of this
            epsilon (one-pass statistics, ``layers.layer_norm``'s "one_pass" form): the next
            in-projection's ``norm=(RowSums, gamma, beta)``, with no pass over the output. The
            statistics' gradient (``RowSums.statistics``) reaches the output through
            ``RowSums.rows``; the kernel's sums themselves carry none (the plain path's are
            differentiable functions of the output: the same gradient for the statistics).
        statistics_tiles: the number of column runs the sums are cut into (the kernel's column
            tiles: ``grouped_projection`` passes its own).

    Returns:
        ``(batch, tokens, N)`` in ``x``'s dtype, or ``parts`` tensors ``(batch, tokens, N / parts)``,
        or ``(pre, activated)`` with ``keep_pre_activation``, or ``(out, RowSums)`` with
        ``statistics_epsilon``.
    """
    w = w.astype(x.dtype)  # as the kernel casts each weight tile: its products are in x's dtype
    if input_activation is not None:  # a given activated: its values, the gradient through x (as the kernel's)
        recomputed = input_activation(x).astype(x.dtype)
        x = recomputed if activated is None else (
            jax.lax.stop_gradient(activated) + (recomputed - jax.lax.stop_gradient(recomputed)))
    if norm is not None:
        x = normalized(x, *with_statistics(norm))
    pieces, start = [], 0
    for size, width in groups:
        rows = x[:, start:start + size]
        if side == "in":
            piece = jnp.dot(rows[..., :width], w[:width], preferred_element_type=jnp.float32) + b.astype(jnp.float32)
            piece = piece if activation is None or keep_pre_activation else activation(piece)
        else:
            piece = jnp.dot(rows, w[:, :width], preferred_element_type=jnp.float32) + b[:width].astype(jnp.float32)
            piece = jnp.pad(piece, ((0, 0), (0, 0), (0, w.shape[1] - width)))
        pieces.append(piece)
        start += size
    out = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)
    if keep_pre_activation:
        return out.astype(x.dtype), jax.lax.stop_gradient(activation(out).astype(x.dtype))
    if scale is not None:
        out = out * gated_scale(scale)[..., None]
    if residual is not None:
        out = out + residual.astype(jnp.float32)
    out = out.astype(x.dtype)
    if statistics_epsilon is not None:
        return out, plain_row_sums(out, statistics_tiles, statistics_epsilon)
    return out if parts == 1 else tuple(jnp.split(out, parts, axis=-1))


def grouped_projection(x, w, b, groups, side, activation=None, residual=None, scale=None, parts=1, norm=None,
                       input_activation=None, keep_pre_activation=False, activated=None, statistics_epsilon=None,
                       tiles=None, interpret=False, in_place=False, residual_sums=None):
    """``plain_grouped_projection`` as one Pallas kernel launch (see the module docstring).

    The training form's MLP is ``pre, activated = grouped_projection(x, w1, b1, ..., "in",
    activation=gelu, keep_pre_activation=True)``, then ``grouped_projection(pre, w2, b2, ...,
    "out", input_activation=gelu, activated=activated)``: fc1's epilogue stores both (no pass of
    XLA's applies the GELU between the kernels), fc2's forward pass reads ``activated`` and its
    backward pass gives ``pre``'s cotangent, the GELU's derivative in its dX kernel. ``activated``
    carries no gradient (a stopped one): its gradient reaches fc1 through ``pre``.

    Args: those of ``plain_grouped_projection``, and
        tiles: ``(block_rows, block_cols, block_k, num_warps, num_stages)`` (the first four powers of 2;
            ``block_cols`` must divide ``N`` and ``block_k`` divide ``K``); where ``None``, those
            ``$KERAS_MONE_PROJECTION_TILES`` names for ``(K, N)``, else ``default_tiles``.
        interpret: run through Pallas' interpreter (no accelerator needed).
        in_place: ``side="out"`` with a ``residual``: a hint that the residual is not needed after
            (an inference block's stream). The kernel then writes into the residual's buffer and
            leaves the column tiles past each group's width as they are, the residual's already:
            an out-projection reads and writes ``d_g / D`` of the stream instead of all of it. With
            ``statistics_epsilon`` it needs ``residual_sums``, the residual's ``RowSums`` per this
            kernel's column tiles (those tiles' sums are the residual's too). Where the residual's
            dtype or sums do not fit, and in a differentiated call, the kernel writes every tile.
            The values are the same either way; under ``jax.jit`` XLA copies the residual first
            if something else still reads it.
        residual_sums: the residual's ``kernels.row_sums.RowSums`` (see ``in_place``).
    """
    groups = checked_groups(x, w, b, groups, side, activation, residual, scale, norm)
    if tiles is None:
        tiles = tile_override(x.shape[-1], w.shape[1]) or default_tiles(x.shape[-1], w.shape[1], x.dtype)
    tiles = tuple(tiles)
    check_tiles(tiles, x.shape[-1], w.shape[1])
    columns = w.shape[1]
    if not isinstance(parts, int) or parts < 1 or columns % parts or (columns // parts) % tiles[1]:
        raise ValueError(f"`parts` must be a positive int that cuts N = {columns} into parts of whole column "
                         f"tiles ({tiles[1]}), got {parts!r}.")
    if parts > 1 and side != "in":
        raise ValueError("`parts` belongs to side 'in' (q, k and v of one kernel).")
    if input_activation is not None and side != "out":
        raise ValueError("`input_activation` belongs to side 'out' (fc2 of the activated hidden units).")
    keep_pre_activation = bool(keep_pre_activation)
    if keep_pre_activation and (side != "in" or activation is None or parts != 1):
        raise ValueError("`keep_pre_activation` belongs to side 'in' with an `activation` and one part (fc1).")
    if activated is not None and (input_activation is None or activated.shape != x.shape
                                  or activated.dtype != x.dtype):
        raise ValueError(f"`activated` must be `input_activation(x)`: it needs `input_activation` and x's shape "
                         f"{x.shape} and dtype {x.dtype}; got {activated.shape} {activated.dtype}.")
    if statistics_epsilon is not None:
        if side != "out" or isinstance(statistics_epsilon, bool) or not isinstance(statistics_epsilon, numbers.Real) \
                or statistics_epsilon < 0:
            raise ValueError(f"`statistics_epsilon` belongs to side 'out' and must be a number >= 0 (a LayerNorm's "
                             f"epsilon); got {statistics_epsilon!r} on side {side!r}.")
        statistics_epsilon = (float(statistics_epsilon), columns // tiles[1])  # (epsilon, column tiles)
    norm = None if norm is None else tuple(norm)
    scale = tuple(jnp.asarray(t) for t in scale) if isinstance(scale, (tuple, list)) else scale
    in_place, sums = _in_place(in_place, residual, residual_sums, x, side, statistics_epsilon)
    out = _jitted(x, w, b, residual, scale, norm, activated, sums, groups, side, activation, parts, tiles,
                  precision_name(), bool(interpret), input_activation, keep_pre_activation, statistics_epsilon,
                  in_place)
    # the activated output carries no gradient: fc2 gives its pre-activations' (see the docstring)
    if keep_pre_activation:
        return out[0], jax.lax.stop_gradient(out[1])
    if statistics_epsilon is not None:  # the sums' gradient goes through the rows (RowSums.statistics)
        out, sums, squares = out
        sums, squares = jax.lax.stop_gradient(sums), jax.lax.stop_gradient(squares)
        return out, RowSums(sums, squares, out.shape[-1], statistics_epsilon[0], rows=out)
    return out


def _in_place(in_place, residual, residual_sums, x, side, statistics):
    """``(in_place, (sums, squares) or None)`` as the launch takes them: ``in_place`` only where it
    fits (see ``grouped_projection``), the residual's sums where the launch stores row sums."""
    if not in_place:
        return False, None
    if side != "out" or residual is None:
        raise ValueError(f"`in_place` belongs to side 'out' with a `residual`; got side {side!r} and "
                         f"{'no' if residual is None else 'a'} residual.")
    sums = None if residual_sums is None or statistics is None else (residual_sums.sums, residual_sums.squares)
    if not in_place_fits(residual, x.dtype, sums, None if statistics is None else statistics[1]):
        return False, None
    return True, sums


def _activated(x, input_activation, activated):
    if activated is not None:
        return activated
    return x if input_activation is None else input_activation(x).astype(x.dtype)


def _launch(x, w, b, residual, scale, norm, groups, side, activation, parts, tiles, precision, interpret, keep_pre,
            statistics, keep_projection=False, in_place=False, residual_sums=None):
    """``(outputs, projection)``: the kernel's outputs (with ``statistics``, ``(epsilon, column
    tiles)``, ``(out, sums, squares)``) and, with ``keep_projection``, the projection before its
    gate and residual, which the gate's gradient needs (else ``None``)."""
    outputs = pallas_projection(x, w, b, residual, scale, norm, groups, side, activation, parts, tiles, precision,
                                interpret, keep_pre=keep_pre or keep_projection, row_sums=statistics is not None,
                                in_place=in_place, residual_sums=residual_sums)
    projection = None
    if keep_projection:
        projection, *outputs = outputs
        outputs = outputs[0] if len(outputs) == 1 else tuple(outputs)
    return outputs, projection


@functools.partial(jax.custom_vjp, nondiff_argnums=tuple(range(8, 19)))
def _projection(x, w, b, residual, scale, norm, activated, residual_sums, groups, side, activation, parts, tiles,
                precision, interpret, input_activation, keep_pre, statistics, in_place):
    return _launch(_activated(x, input_activation, activated), w, b, residual, scale, norm, groups, side, activation,
                   parts, tiles, precision, interpret, keep_pre, statistics, in_place=in_place,
                   residual_sums=residual_sums)[0]


def _projection_forward(x, w, b, residual, scale, norm, activated, residual_sums, groups, side, activation, parts,
                        tiles, precision, interpret, input_activation, keep_pre, statistics, in_place):
    # (differentiated: every tile written, the residual kept for the caller; in_place is inference's)
    activated = _activated(x, input_activation, activated)
    # (a gated fc2 of the activation: its dX kernel sums the gate's gradient, nothing kept for it)
    keep_projection = scale is not None and input_activation is None
    outputs, projection = _launch(activated, w, b, residual, scale, norm, groups, side, activation, parts, tiles,
                                  precision, interpret, keep_pre, statistics, keep_projection=keep_projection)
    saved_activated = None if input_activation is None else activated
    return outputs, (x, w, b, residual, scale, norm, saved_activated, projection)


def _projection_backward(groups, side, activation, parts, tiles, precision, interpret, input_activation, keep_pre,
                         statistics, in_place, saved, upstream):
    """dX and dW by grouped kernels (``kernels.grouped_gradients``) unless the epilogue applies an
    activation or the prologue finishes a ``RowSums`` (the inference forms; then the plain path's
    gradients, recomputed from the inputs). fc1 keeping its pre-activations: only they carry a
    gradient. An out-projection's residual gets the output's cotangent, its gate (``scale``)
    ``sum_D(d out * projection)``: a gated fc2's (``input_activation``) from its dX kernel
    (``projection_gradients``' ``scale``), another's from the projection its forward pass kept
    (``_scaled_cotangent``). Row sums get no cotangent (``grouped_projection`` stops it: their
    statistics' gradient reaches the output through ``RowSums.rows``). Nothing but the inputs,
    an ``input_activation``'s output (which dW needs) and a gated projection is kept between
    the passes. A given ``activated`` gets no cotangent (``None``: zero)."""
    *inputs, activated, projection = saved
    x, w, b, residual, scale, norm = inputs
    summed = norm is not None and len(norm) == 3  # (RowSums, gamma, beta): inference's form
    if (activation is None or keep_pre) and not summed:
        # with keep_pre only the pre-activations carry a cotangent: grouped_projection stopped the other's
        # with statistics only the output carries a cotangent: grouped_projection stopped the sums'
        dy = upstream[0] if keep_pre or statistics is not None else upstream
        d_residual = None if residual is None else dy.astype(residual.dtype)
        if projection is not None:  # kept for the gate's gradient; else a gated fc2's dX kernel sums it
            dy, d_scale = _scaled_cotangent(dy, projection, scale)
        dx, dw, db, _, d_gate, dnorm = projection_gradients(
            x, w, b, norm, groups, side, parts, precision, interpret, dy, input_activation, activated,
            scale if projection is None else None)
        return dx, dw, db, d_residual, d_gate if projection is None else d_scale, dnorm, None, None

    def plain(x, w, b, residual, scale, norm):  # (side "in": an activation epilogue or a RowSums prologue)
        return plain_grouped_projection(x, w, b, groups, side, activation, residual, scale, parts, norm,
                                        input_activation, keep_pre_activation=keep_pre)

    with precision_context(precision):
        _, pullback = jax.vjp(plain, *inputs)
        return (*pullback(upstream), None, None)


def _scaled_cotangent(dy, projection, scale):
    """``(factor * dy, d scale)`` for ``out = residual + factor * projection``: the projection's
    cotangent and the scale's, ``sum_D(dy * projection)`` per row, through MoNE's ``alpha g + 1``
    for a ``(gate, alpha)`` pair (Eq. 1), in float32, each cast to its input's dtype."""
    wide = dy.astype(jnp.float32)
    product = jnp.sum(wide * projection.astype(jnp.float32), axis=-1)
    return (wide * gated_scale(scale)[..., None]).astype(dy.dtype), gate_cotangents(product, scale)


_projection.defvjp(_projection_forward, _projection_backward)
# compiled once per (shapes, groups, side, activation, tiles, input activation, keep_pre, statistics): eager calls
# reuse the kernel
_jitted = jax.jit(_projection, static_argnums=tuple(range(8, 19)))
