"""A LayerNorm's one-pass statistics carried as row sums from the kernel that wrote its input (jax).

Why (issue 40). In the grouped-kernel forward every LayerNorm's input is a residual stream an
out-projection has just written (``kernels.grouped_projection``). That kernel's programs sum the
rows they store (``statistics_epsilon``), per column tile; the next in-projection's prologue
finishes the statistics per row from those partial sums (``norm=(RowSums, gamma, beta)``), so
neither a reduction over the stream nor a pass making mean and rstd runs between the kernels.

The statistics are the one-pass form's (``layers.layer_norm``'s "one_pass", jax's GPU default):
``mean = E[y]``, ``rstd = rsqrt(max(E[y^2] - mean^2, 0) + epsilon)`` of the stored values, in
float32.
"""

import jax
import jax.numpy as jnp


@jax.tree_util.register_pytree_node_class
class RowSums:
    """Rows' partial sums and sums of squares, ``(tiles, batch, tokens)`` float32 each (one entry
    per column tile of the kernel that stored the rows), of rows of ``features`` values, for a
    LayerNorm of ``epsilon``. A pytree: the arrays are its leaves, ``features`` and ``epsilon``
    static."""

    def __init__(self, sums, squares, features, epsilon):
        self.sums, self.squares, self.features, self.epsilon = sums, squares, int(features), float(epsilon)

    def tree_flatten(self):
        return (self.sums, self.squares), (self.features, self.epsilon)

    @classmethod
    def tree_unflatten(cls, static, leaves):
        return cls(*leaves, *static)

    def statistics(self):
        """``(mean, rstd)``, each ``(batch, tokens)`` float32 (``one_pass``)."""
        return one_pass(jnp.sum(self.sums, axis=0), jnp.sum(self.squares, axis=0), self.features, self.epsilon)


def one_pass(sums, squares, features, epsilon):
    """``(mean, rsqrt(max(E[y^2] - mean^2, 0) + epsilon))`` from rows' sums and sums of squares."""
    mean = sums / features
    variance = jnp.maximum(squares / features - mean * mean, 0.0)
    return mean, jax.lax.rsqrt(variance + jnp.float32(epsilon))


def plain_row_sums(out, tiles, epsilon):
    """``RowSums`` of ``out`` ``(batch, tokens, N)`` with XLA's ops: its columns cut into ``tiles``
    equal runs, as the kernel's column tiles sum them (the reference the kernel equals)."""
    batch, tokens, features = out.shape
    wide = jnp.moveaxis(out.astype(jnp.float32).reshape(batch, tokens, tiles, features // tiles), 2, 0)
    return RowSums(jnp.sum(wide, axis=-1), jnp.sum(wide * wide, axis=-1), features, epsilon)


def with_statistics(norm):
    """A prologue's ``norm`` as ``(mean, rstd, gamma, beta)``: ``(RowSums, gamma, beta)`` finished
    (``RowSums.statistics``), other forms as given."""
    if norm is not None and len(norm) == 3 and isinstance(norm[0], RowSums):
        return (*norm[0].statistics(), norm[1], norm[2])
    return norm


def output_cotangent(out, out_cotangent, sums_cotangent):
    """The cotangent of ``out`` ``(batch, tokens, N)``, whose ``RowSums`` a kernel also gave, from
    both outputs' cotangents: ``d out + d sums + 2 out d squares``, each row's sum and square
    cotangent spread over its column tile's run (the vjp of ``plain_row_sums``; a training
    call's statistics reach the residual stream through it). In ``out_cotangent``'s dtype."""
    batch, tokens, features = out.shape
    tiles = sums_cotangent.sums.shape[0]
    wide = out.astype(jnp.float32).reshape(batch, tokens, tiles, features // tiles)
    sums, squares = (jnp.moveaxis(t, 0, 2)[..., None] for t in (sums_cotangent.sums, sums_cotangent.squares))
    spread = (sums + 2.0 * wide * squares).reshape(out.shape)
    return (out_cotangent.astype(jnp.float32) + spread).astype(out_cotangent.dtype)
