"""The fused kernels against the plain path on this machine's device, at ViT-B/16's shapes.

CI tests the kernels through Pallas' interpreter; this checks what the GPU's compiler made
of them (``bench/gpu.sh`` runs it before timing anything). For each nested width and
dtype: the largest difference between kernel and plain path, forward and (``fused half``)
gradients, relative to the largest plain value; exit status 1 if any exceeds its bound
(bfloat16: 2^-6, a few bf16 ulps; float32: 1e-5 on a CPU, 2^-9 on a GPU, where both paths
may multiply in TF32, jax's default there, in different orders).

    KERAS_BACKEND=jax python bench/kernel_check.py                 # a GPU: compiled kernels
    KERAS_BACKEND=jax python bench/kernel_check.py --rows 64       # elsewhere: interpreted (slow)
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from keras_mone.kernels.fused_nested_mlp import fused_nested_mlp, plain_nested_mlp
from keras_mone.kernels.fused_residual_mlp import fused_residual_mlp, plain_residual_mlp
from keras_mone.layers.mlp import _kernel_gelu

BOUNDS = {"float32": 1e-5, "bfloat16": 2.0 ** -6}
GPU_BOUNDS = {**BOUNDS, "float32": 2.0 ** -9}


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
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max())))


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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="96,192,384")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rows", type=int, default=256 * 62, help="token rows of a group (default: batch 256)")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=3072)
    args = parser.parse_args()
    interpret = jax.default_backend() != "gpu"
    bounds = BOUNDS if interpret else GPU_BOUNDS
    print(f"Fused kernels against the plain path on {jax.devices()[0].device_kind} "
          f"({'interpreted' if interpret else 'compiled'}), {args.rows} rows, D={args.dim}, H={args.hidden}\n")
    print("| d | dtype | form | max error / max value | bound |")
    print("|---|---|---|---|---|")
    failed = False
    for dtype in args.dtypes.split(","):
        for width in (int(w) for w in args.widths.split(",")):
            for form, error in check(width, dtype, args.rows, args.dim, args.hidden, interpret).items():
                failed |= error > bounds[dtype]
                print(f"| {width} | {dtype} | {form} | {error:.2e} | {bounds[dtype]:.1e} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
