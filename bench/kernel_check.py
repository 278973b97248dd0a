"""The fused kernels against the plain path on this machine's device, at ViT-B/16's shapes.

CI tests the kernels through Pallas' interpreter; this checks what the GPU's compiler made
of them (``bench/gpu.sh`` runs it before timing anything). For each nested width and
dtype: the largest difference between kernel and plain path, forward and (``fused half``)
gradients, relative to the largest plain value; exit status 1 if any exceeds its bound
(bfloat16: 2^-6, a few bf16 ulps; float32: 1e-5 on a CPU, 2^-9 on a GPU, where both paths
may multiply in TF32, jax's default there, in different orders).

``grouped block``: the grouped projection kernels (``kernels.grouped_projection``) of a training
call's block (q/k/v from the LayerNorm's statistics, the attention's out-projection with its
residual and row sums, fc1 keeping its pre-activations, fc2 of the GELU with the residual,
MoNE's gate and row sums) at MoNE-ViT-B/16's token groups, e_c 0.3, ``--grouped-batch`` images:
the outputs and the gradients of every input (``kernels.grouped_gradients``' backward kernels)
against the plain path's; and an inference call's block, its out-projections in place
(``in_place``: only the groups' column tiles written into the residual's buffer). float32 runs
at jax's "highest" matmul precision on both paths (no TF32: the products' order is the only
difference, bound 1e-5); bfloat16 at its default, bound 2^-4: both paths round at other points,
and alpha's gradient, one sum over every row of terms of both signs, differed by 2.1e-2 of its
value between them at D = 32 (interpreted; 8e-3 at D = 64).

    KERAS_BACKEND=jax python bench/kernel_check.py                 # a GPU: compiled kernels
    KERAS_BACKEND=jax python bench/kernel_check.py --rows 64       # elsewhere: interpreted (slow)
    KERAS_BACKEND=jax python bench/kernel_check.py --widths= --dim 64 --grouped-batch 1   # the grouped block alone
"""

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from keras_mone.kernels.fused_nested_mlp import fused_nested_mlp, plain_nested_mlp
from keras_mone.kernels.fused_residual_mlp import fused_residual_mlp, plain_residual_mlp
from keras_mone.kernels.grouped_projection import grouped_projection, plain_grouped_projection
from keras_mone.kernels.row_sums import plain_row_sums
from keras_mone.kernels.tiles import largest_power_of_2_dividing
from keras_mone.layers.mlp import _kernel_gelu

BOUNDS = {"float32": 1e-5, "bfloat16": 2.0 ** -6}
GPU_BOUNDS = {**BOUNDS, "float32": 2.0 ** -9}
GROUPED_BOUNDS = {"float32": 1e-5, "bfloat16": 2.0 ** -4}
TOKENS = (84, 61, 37, 14)
"""MoNE-ViT-B/16's tokens per expert at e_c 0.3, whose widths are D/8, D/4, D/2 and D."""


def kernel_inputs(rows, dim, hidden, dtype, seed=0):
    """Random ``(z, (gamma, beta), (w1, b1, w2, b2), scale)`` for both kernels: ``rows`` token
    rows ``dim`` wide in ``dtype``, the LayerNorm's weights in float32, an MLP ``hidden`` wide."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 8)
    normal = lambda key, *shape, s=1.0: (s * jax.random.normal(key, shape)).astype(dtype)  # noqa: E731
    z = normal(keys[0], rows, dim)
    norm = (1.0 + normal(keys[1], dim, s=0.1)).astype(jnp.float32), normal(keys[2], dim, s=0.1).astype(jnp.float32)
    mlp = (normal(keys[3], dim, hidden, s=dim ** -0.5), normal(keys[4], hidden, s=0.1),
           normal(keys[5], hidden, dim, s=hidden ** -0.5), normal(keys[6], dim, s=0.1))
    scale = (1.0 + 0.5 * jax.random.uniform(keys[7], (rows,))).astype(dtype)
    return z, norm, mlp, scale


def relative_error(got, want):
    """``max |got - want| / max(1, max |want|)``; infinite where either is not finite (so that a NaN
    fails every bound: it compares false with each)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    difference = np.abs(got - want)
    if not np.all(np.isfinite(difference)):
        return float("inf")
    return float(difference.max() / max(1.0, float(np.abs(want).max())))


def check(width, dtype, rows, dim, hidden, interpret):
    """``{form: relative error}`` of both kernels (and the block kernel's gradients) at one width."""
    z, norm, mlp, scale = kernel_inputs(rows, dim, hidden, dtype)
    gelu = _kernel_gelu(False)
    errors = {"fused MLP": relative_error(fused_nested_mlp(z, *mlp, width, gelu, interpret=interpret),
                                          plain_nested_mlp(z, *mlp, width, gelu))}
    arguments = (z, *norm, *mlp, scale)
    fused = jax.jit(lambda *a: fused_residual_mlp(*a, width, gelu, interpret=interpret))
    plain = jax.jit(lambda *a: plain_residual_mlp(*a, width, gelu, 1e-6))
    errors["fused half"] = relative_error(fused(*arguments), plain(*arguments))
    # squared: the backward pass (the plain path, recomputed) sees each path's own outputs
    grads = [jax.grad(lambda *a, f=f: jnp.sum(jnp.square(f(*a).astype(jnp.float32))), argnums=(0, 3))(*arguments)
             for f in (fused, plain)]
    errors["fused half, gradients"] = max(relative_error(g, p) for g, p in zip(*grads))
    return errors


def grouped_block(kernel, x, statistics, weights, gate, groups, interpret):
    """A training call's block through the grouped projections (``kernel``) or their plain twins:
    ``(out, mean, rstd)`` of its output rows. q * k + v stands in for the attention."""
    (gamma1, beta1, wqkv, bqkv, wo, bo), (gamma2, beta2, w1, b1, w2, b2) = weights
    project = functools.partial(grouped_projection, interpret=interpret) if kernel else functools.partial(
        plain_grouped_projection, statistics_tiles=x.shape[-1] // largest_power_of_2_dividing(x.shape[-1], 128))
    gelu = _kernel_gelu(False)
    q, k, v = project(x, wqkv, bqkv, groups, "in", parts=3, norm=(*statistics, gamma1, beta1))
    mid, sums = project(q * k + v, wo, bo, groups, "out", residual=x, statistics_epsilon=1e-6)
    sums = sums if kernel else sums.with_rows(None)  # the plain path's statistics: autodiff of its sums
    pre, activated = project(mid, w1, b1, groups, "in", activation=gelu, keep_pre_activation=True,
                             norm=(*sums.statistics(), gamma2, beta2))
    out, sums = project(pre, w2, b2, groups, "out", residual=mid, scale=gate, input_activation=gelu,
                        activated=activated, statistics_epsilon=1e-6)
    return (out, *(sums if kernel else sums.with_rows(None)).statistics())


def inference_block(kernel, x, x_sums, weights, gate, groups, interpret):
    """An inference call's block through the grouped projections (``kernel``), each out-projection
    writing into its residual's buffer only its groups' column tiles (``in_place``, the residual's
    row sums ``x_sums`` kept past them), or their plain twins: ``(out, mean, rstd)``."""
    (gamma1, beta1, wqkv, bqkv, wo, bo), (gamma2, beta2, w1, b1, w2, b2) = weights
    project = functools.partial(grouped_projection, interpret=interpret) if kernel else functools.partial(
        plain_grouped_projection, statistics_tiles=x_sums.sums.shape[0])
    in_place = (lambda sums: dict(in_place=True, residual_sums=sums)) if kernel else (lambda sums: {})
    q, k, v = project(x, wqkv, bqkv, groups, "in", parts=3, norm=(x_sums, gamma1, beta1))
    mid, sums = project(q * k + v, wo, bo, groups, "out", residual=x, statistics_epsilon=1e-6, **in_place(x_sums))
    hidden = project(mid, w1, b1, groups, "in", activation=_kernel_gelu(False), norm=(sums, gamma2, beta2))
    out, sums = project(hidden, w2, b2, groups, "out", residual=mid, scale=gate, statistics_epsilon=1e-6,
                        **in_place(sums))
    return (out, *sums.statistics())


def grouped_check(dtype, batch, dim, interpret):
    """``{form: relative error}`` of ``grouped_block``'s outputs and of the gradients of every input."""
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 20))
    normal = lambda *shape, s=1.0: s * jax.random.normal(next(keys), shape)  # noqa: E731
    groups = tuple(zip(TOKENS, (dim // 8, dim // 4, dim // 2, dim)))
    hidden, tokens = 4 * dim, sum(TOKENS)
    x = normal(batch, tokens, dim).astype(dtype)
    wide = x.astype(jnp.float32)
    statistics = (wide.mean(-1), jax.lax.rsqrt(wide.var(-1) + 1e-6))
    norm = lambda: (1.0 + normal(dim, s=0.1), normal(dim, s=0.1))  # noqa: E731
    weights = ((*norm(), normal(dim, 3 * dim, s=dim ** -0.5), normal(3 * dim, s=0.1), normal(dim, dim, s=dim ** -0.5),
                normal(dim, s=0.1)),
               (*norm(), normal(dim, hidden, s=dim ** -0.5), normal(hidden, s=0.1),
                normal(hidden, dim, s=hidden ** -0.5), normal(dim, s=0.1)))
    gate = (jax.random.uniform(next(keys), (batch, tokens)).astype(dtype), jnp.float32(0.7))
    cotangents = [normal(batch, tokens, dim), normal(batch, tokens), normal(batch, tokens)]
    errors = {}

    def loss(kernel):
        def value(x, statistics, weights, gate):
            outputs = grouped_block(kernel, x, statistics, weights, gate, groups, interpret)
            return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outputs, cotangents)), outputs
        return jax.jit(jax.value_and_grad(value, argnums=(0, 1, 2, 3), has_aux=True))

    precision = "highest" if dtype == "float32" else "default"
    with jax.default_matmul_precision(precision):
        (_, got), got_grads = loss(True)(x, statistics, weights, gate)
        (_, want), want_grads = loss(False)(x, statistics, weights, gate)
    errors["grouped block"] = max(relative_error(g, w) for g, w in zip(got, want))
    errors["grouped block, gradients"] = max(relative_error(g, w) for g, w in zip(
        jax.tree_util.tree_leaves(got_grads), jax.tree_util.tree_leaves(want_grads)))
    x_sums = plain_row_sums(x, dim // largest_power_of_2_dividing(dim, 128), 1e-6).with_rows(None)
    with jax.default_matmul_precision(precision):
        got, want = (jax.jit(functools.partial(inference_block, kernel, groups=groups, interpret=interpret))(
            x, x_sums, weights, gate) for kernel in (True, False))
    errors["grouped block, inference in place"] = max(relative_error(g, w) for g, w in zip(got, want))
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="96,192,384", help="the fused kernels' nested widths ('': none)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rows", type=int, default=256 * 62, help="token rows of a group (default: batch 256)")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--grouped-batch", type=int, default=16, help="images of the grouped block check (0: none)")
    args = parser.parse_args()
    interpret = jax.default_backend() != "gpu"
    bounds = BOUNDS if interpret else GPU_BOUNDS
    print(f"Fused kernels against the plain path on {jax.devices()[0].device_kind} "
          f"({'interpreted' if interpret else 'compiled'}), {args.rows} rows, D={args.dim}, H={args.hidden}; "
          f"the grouped block: {args.grouped_batch} images of {sum(TOKENS)} tokens, H = 4 D\n")
    print("| d | dtype | form | max error / max value | bound |")
    print("|---|---|---|---|---|")
    failed = False
    for dtype in args.dtypes.split(","):
        for width in (int(w) for w in args.widths.split(",") if w.strip()):  # (--widths=: the grouped block only)
            for form, error in check(width, dtype, args.rows, args.dim, args.hidden, interpret).items():
                failed |= error > bounds[dtype]
                print(f"| {width} | {dtype} | {form} | {error:.2e} | {bounds[dtype]:.1e} |")
        if args.grouped_batch:
            for form, error in grouped_check(dtype, args.grouped_batch, args.dim, interpret).items():
                failed |= error > GROUPED_BOUNDS[dtype]
                print(f"| e_c 0.3 | {dtype} | {form} | {error:.2e} | {GROUPED_BOUNDS[dtype]:.1e} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
