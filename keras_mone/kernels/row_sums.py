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

import functools

import jax
import jax.numpy as jnp


@jax.tree_util.register_pytree_node_class
class RowSums:
    """Rows' partial sums and sums of squares, ``(tiles, batch, tokens)`` float32 each (one entry
    per column tile of the kernel that stored the rows), of rows of ``features`` values, for a
    LayerNorm of ``epsilon``; ``rows``, the ``(batch, tokens, features)`` values summed (or
    ``None``), through which the statistics' gradient flows (``statistics``). A pytree: the arrays
    are its leaves, ``features`` and ``epsilon`` static."""

    def __init__(self, sums, squares, features, epsilon, rows=None):
        self.sums, self.squares, self.features, self.epsilon = sums, squares, int(features), float(epsilon)
        self.rows = rows

    def tree_flatten(self):
        return (self.sums, self.squares, self.rows), (self.features, self.epsilon)

    @classmethod
    def tree_unflatten(cls, static, leaves):
        sums, squares, rows = leaves
        return cls(sums, squares, *static, rows=rows)

    def with_rows(self, rows):
        """The same sums, their gradient through ``rows`` (or none: ``None``)."""
        return RowSums(self.sums, self.squares, self.features, self.epsilon, rows=rows)

    def statistics(self):
        """``(mean, rstd)``, each ``(batch, tokens)`` float32 (``one_pass``). With ``rows`` their
        gradient reaches the rows (``d rows = d sum + 2 rows d square``, the sums' vjp) and not
        the sums: a kernel's sums need no backward pass of their own, and XLA fuses this one into
        the LayerNorm's other elementwise cotangent work on the same rows."""
        if self.rows is None:
            return _finish(self.sums, self.squares, self.features, self.epsilon)
        return _finished_through_rows(self.sums, self.squares, self.rows, self.features, self.epsilon)


def one_pass(sums, squares, features, epsilon):
    """``(mean, rsqrt(max(E[y^2] - mean^2, 0) + epsilon))`` from rows' sums and sums of squares."""
    mean = sums / features
    variance = jnp.maximum(squares / features - mean * mean, 0.0)
    return mean, jax.lax.rsqrt(variance + jnp.float32(epsilon))


def _finish(sums, squares, features, epsilon):
    return one_pass(jnp.sum(sums, axis=0), jnp.sum(squares, axis=0), features, epsilon)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _finished_through_rows(sums, squares, rows, features, epsilon):
    return _finish(sums, squares, features, epsilon)


def _finish_forward(sums, squares, rows, features, epsilon):
    totals = (jnp.sum(sums, axis=0), jnp.sum(squares, axis=0))
    return one_pass(*totals, features, epsilon), (totals, rows, sums, squares)


def _finish_backward(features, epsilon, saved, cotangent):
    (total, total_squares), rows, sums, squares = saved
    _, pullback = jax.vjp(lambda s, q: one_pass(s, q, features, epsilon), total, total_squares)
    d_sum, d_square = pullback(cotangent)
    d_rows = d_sum[..., None] + 2.0 * rows.astype(jnp.float32) * d_square[..., None]
    return jnp.zeros_like(sums), jnp.zeros_like(squares), d_rows.astype(rows.dtype)


_finished_through_rows.defvjp(_finish_forward, _finish_backward)


def plain_row_sums(out, tiles, epsilon):
    """``RowSums`` of ``out`` ``(batch, tokens, N)`` with XLA's ops: its columns cut into ``tiles``
    equal runs, as the kernel's column tiles sum them (the reference the kernel equals)."""
    batch, tokens, features = out.shape
    wide = jnp.moveaxis(out.astype(jnp.float32).reshape(batch, tokens, tiles, features // tiles), 2, 0)
    return RowSums(jnp.sum(wide, axis=-1), jnp.sum(wide * wide, axis=-1), features, epsilon, rows=out)


def with_statistics(norm):
    """A prologue's ``norm`` as ``(mean, rstd, gamma, beta)``: ``(RowSums, gamma, beta)`` finished
    (``RowSums.statistics``), other forms as given."""
    if norm is not None and len(norm) == 3 and isinstance(norm[0], RowSums):
        return (*norm[0].statistics(), norm[1], norm[2])
    return norm
