"""Softmax attention as one Pallas kernel that never writes the scores (jax; FlashAttention-2's
forward pass, Dao 2023, Algorithm 1).

Why (issue 40). On jax's GPU, bf16 attention is cuDNN's flash attention, but cuDNN takes no
float32, and there XLA writes the ``(B, H, N, N)`` scores, reads them back for the softmax,
writes the probabilities and reads them again for the product with ``v``, after transposing q,
k and v heads-first. Compiled for an H200, that is about 3 of the 7.83 GB that MoNE-ViViT-FE-B/16
moves at batch 1 (float32, e_c 0.4, with the grouped projection kernels), and as large in dense:
MoNE's savings shrink by the attention they share (BENCHMARKS.md, "Flash attention in float32").

Here a program takes ``block_q`` query rows of one head of one example, keeps them on chip,
and walks the keys in ``block_k`` tiles, carrying the running row maximum ``m``, the running
sum ``l`` of ``exp(s - m)`` and the unnormalised output (online softmax; each new tile
rescales them by ``exp(m_old - m_new)``); the output is divided by ``l`` once, at the end. q,
k and v are read in the layout attention's callers hold them, ``(B, N, H, d)``: no transposes.
Rows past a sequence's end (N need not be a multiple of the tiles: ViT's 197 tokens) are
masked.

``plain_attention`` is the same softmax with XLA's ops: the reference the kernel equals
(float32 scores and softmax in both) and its backward pass, which recomputes it from q, k and
v. The backward pass is therefore XLA's attention: a training step under this form writes and
keeps the ``(B, H, N, N)`` float32 scores and probabilities as XLA's form does, and computes
the forward twice (an inference form; FlashAttention-2's backward, Alg. 2, is not built).
``interpret=True`` runs the kernel through Pallas' interpreter (any platform: how CI tests
it). Products follow jax's ``default_matmul_precision`` (``kernels.precision``).
"""

import functools
import math
import re

import jax
import jax.numpy as jnp

from keras_mone.kernels.precision import dot_precision, precision_context, precision_name
from keras_mone.kernels.tiles import launchable, shape_tiles

TILES_ENV = "KERAS_MONE_ATTENTION_TILES"
"""Tiles per sequence shape, ``QxK=block_q,block_k,num_warps,num_stages`` entries separated by ``;``
(e.g. ``257x257=64,64,4,2;17x17=16,16,4,2``: queries x keys), which ``flash_attention`` takes
over ``default_tiles``; ``bench/attention_tiles.py`` screens settings on a card and prints them."""


def plain_attention(query, key, value):
    """``softmax(q k^T / sqrt(d)) v`` with XLA's ops, scores and softmax in float32.

    Args:
        query: ``(batch, queries, heads, head_dim)``.
        key, value: ``(batch, keys, heads, head_dim)``, ``query``'s dtype.

    Returns:
        ``(batch, queries, heads, head_dim)`` in ``query``'s dtype.
    """
    precision = dot_precision(precision_name())
    scores = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32, precision=precision)
    weights = jax.nn.softmax(scores * (query.shape[-1] ** -0.5), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(value.dtype), value, preferred_element_type=jnp.float32,
                     precision=precision)
    return out.astype(query.dtype)


def flash_attention(query, key, value, tiles=None, interpret=False):
    """``plain_attention`` as one Pallas kernel launch (see the module docstring).

    Args: those of ``plain_attention``, and
        tiles: ``(block_q, block_k, num_warps, num_stages)``, the first three powers of 2 and
            both blocks at least 16; ``None``: ``$KERAS_MONE_ATTENTION_TILES``' entry for this
            sequence shape (``tile_override``), else ``default_tiles``.
        interpret: run through Pallas' interpreter (no accelerator needed).
    """
    check_inputs(query, key, value)
    if tiles is None:
        tiles = tile_override(query.shape[1], key.shape[1]) or default_tiles(query.shape[-1], query.dtype)
    tiles = tuple(tiles)
    check_tiles(tiles)
    return _jitted(query, key, value, tiles, precision_name(), bool(interpret))


def shape_fits(head_dim):
    """Whether the kernel takes this head size: a power of 2 of at least 16 (Triton's smallest
    dot; every ViT from Ti to H has 64)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def default_tiles(head_dim, dtype):
    """``(64, 64, 4, 2)``: 64 query rows and 64 keys per step on one warpgroup, two stages.
    Compiled for sm_90 without a card at ``head_dim`` 64 (``bench/kernel_compile.py``'s
    ``compile_stats``; BENCHMARKS.md, "Flash attention in float32"). Not screened on a card."""
    del head_dim, dtype  # one setting until a card screens others
    return (64, 64, 4, 2)


def tile_override(queries, keys):
    """The tiles ``$KERAS_MONE_ATTENTION_TILES`` names for ``queries`` x ``keys`` sequences, or
    ``None``; a malformed entry or tiles the kernel cannot take raise ``ValueError`` naming the
    variable."""
    def check(tiles, *_):
        if not launchable(tiles, blocks=2):
            raise ValueError(f"${TILES_ENV}: tiles must be (block_q, block_k, num_warps, num_stages): powers of 2, "
                             f"both blocks at least 16, a positive stage count; got {tiles!r} for {queries}x{keys}.")
    return shape_tiles(TILES_ENV, queries, keys, check, key="QxK", example="257x257=64,64,4,2")


def check_inputs(query, key, value):
    """Raises ``ValueError`` naming what is wrong with ``query``, ``key`` and ``value``."""
    if query.ndim != 4 or key.ndim != 4 or key.shape != value.shape:
        raise ValueError(f"`query` must be (batch, queries, heads, head_dim) and `key` and `value` (batch, keys, "
                         f"heads, head_dim); got {query.shape}, {key.shape} and {value.shape}.")
    if query.shape[0] != key.shape[0] or query.shape[2:] != key.shape[2:]:
        raise ValueError(f"`query`, `key` and `value` must agree in batch, heads and head_dim; got {query.shape}, "
                         f"{key.shape} and {value.shape}.")
    if not jnp.issubdtype(query.dtype, jnp.floating) or not query.dtype == key.dtype == value.dtype:
        raise ValueError(f"`query`, `key` and `value` must share one floating dtype; got {query.dtype}, "
                         f"{key.dtype} and {value.dtype}.")
    if not shape_fits(query.shape[-1]):
        raise ValueError(f"`head_dim` must be a power of 2 of at least 16 for the kernel, got {query.shape[-1]}.")
    if key.shape[1] < 1:
        raise ValueError("`key` and `value` must hold at least one key.")


def check_tiles(tiles):
    """Raises ``ValueError`` naming what is wrong with ``tiles``."""
    if not launchable(tuple(tiles), blocks=2):
        raise ValueError(f"`tiles` must be (block_q, block_k, num_warps, num_stages): powers of 2, both blocks "
                         f"at least 16 (Triton's dot), and a positive stage count; got {tiles!r}.")


def kernel_label(batch, queries, keys, heads, head_dim):
    """The name the kernel is compiled under, from which a program's reader counts its work
    (``labelled_cost``): ``flash_attention_b1_q257_k257_h12_d64``."""
    return f"flash_attention_b{batch}_q{queries}_k{keys}_h{heads}_d{head_dim}"


_LABEL = re.compile(r"flash_attention_b(\d+)_q(\d+)_k(\d+)_h(\d+)_d(\d+)")


def labelled_cost(name, itemsize):
    """``(FLOPs, bytes)`` of a kernel named by ``kernel_label``, or ``None`` for another name:
    ``4 B H Nq Nk d`` FLOPs (the two products) and q, k, v and the output read or written once
    (k and v, read by every query tile of their head, are counted once: L2 holds them)."""
    match = _LABEL.search(name)
    if match is None:
        return None
    batch, queries, keys, heads, head_dim = (int(v) for v in match.groups())
    flops = 4 * batch * heads * queries * keys * head_dim
    return flops, itemsize * batch * heads * head_dim * (2 * queries + 2 * keys)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(query, key, value, tiles, precision, interpret):
    return _pallas_attention(query, key, value, tiles, precision, interpret)


def _attention_forward(query, key, value, tiles, precision, interpret):
    return _attention(query, key, value, tiles, precision, interpret), (query, key, value)


def _attention_backward(tiles, precision, interpret, saved, upstream):
    """The plain path's gradients, recomputed from q, k and v (nothing else is kept)."""
    with precision_context(precision):
        _, pullback = jax.vjp(plain_attention, *saved)
        return pullback(upstream)


_attention.defvjp(_attention_forward, _attention_backward)
_jitted = jax.jit(_attention, static_argnums=(3, 4, 5))


def _pallas_attention(query, key, value, tiles, precision, interpret):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    batch, queries, heads, head_dim = query.shape
    keys = key.shape[1]
    block_q, block_k, num_warps, num_stages = tiles
    kernel = functools.partial(
        _attention_tile, queries=queries, keys=keys, heads=heads, blocks=(block_q, block_k),
        precision=dot_precision(precision))
    rows = [t.reshape(batch * t.shape[1], heads * head_dim) for t in (query, key, value)]  # free reshapes
    out = pl.pallas_call(
        kernel,
        grid=(-(-queries // block_q), batch * heads),
        out_shape=jax.ShapeDtypeStruct(rows[0].shape, query.dtype),
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=kernel_label(batch, queries, keys, heads, head_dim),
    )(*rows)
    return out.reshape(query.shape)


def _attention_tile(q_ref, k_ref, v_ref, o_ref, *, queries, keys, heads, blocks, precision):
    """One program: ``block_q`` query rows of one head of one example, over every key."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    block_q, block_k = blocks
    head_dim = q_ref.shape[1] // heads
    query_tile, sequence = pl.program_id(0), pl.program_id(1)
    example, head = jax.lax.div(sequence, heads), jax.lax.rem(sequence, heads)
    features = (head * head_dim + jnp.arange(head_dim, dtype=jnp.int32))[None, :]

    def rows_of(tile, block, length, ref):  # (rows of ref's (B N, H d) view, valid)
        index = tile * block + jnp.arange(block, dtype=jnp.int32)
        valid = index < length
        # rows past the sequence's end point past the array: masked on the card, dropped by the
        # interpreter's scatter (an in-range row there would be written twice in one store)
        return jnp.where(valid, example * length + index, ref.shape[0]), valid

    query_rows, query_valid = rows_of(query_tile, block_q, queries, q_ref)
    q = pl_triton.load(q_ref.at[query_rows[:, None], features], mask=query_valid[:, None], other=0)
    scale = 1.0 / math.sqrt(head_dim)

    def step(tile, carry):
        out, running_max, running_sum = carry
        key_rows, key_valid = rows_of(tile, block_k, keys, k_ref)
        k = pl_triton.load(k_ref.at[key_rows[:, None], features], mask=key_valid[:, None], other=0)
        v = pl_triton.load(v_ref.at[key_rows[:, None], features], mask=key_valid[:, None], other=0)
        scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32) * scale
        scores = jnp.where(key_valid[None, :], scores, -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=1))  # finite: each tile has a key
        correction = jnp.exp(running_max - new_max)
        weights = jnp.exp(scores - new_max[:, None])
        running_sum = running_sum * correction + jnp.sum(weights, axis=1)
        update = jnp.dot(weights.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
        return out * correction[:, None] + update, new_max, running_sum

    start = (jnp.zeros((block_q, head_dim), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    out, _, running_sum = jax.lax.fori_loop(0, -(-keys // block_k), step, start)
    out = (out / running_sum[:, None]).astype(o_ref.dtype)
    pl_triton.store(o_ref.at[query_rows[:, None], features], out, mask=query_valid[:, None])
