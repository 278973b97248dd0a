"""Kernel ops, Keras layer calls, torch.compile graphs and peak allocations of one forward pass on torch:
dense ViT against MoNE-ViT.

Eager torch pays host time for every op and layer call, so on a GPU these
counts, not the MACs, bound a forward pass (issue 40 item 3). torch's
dispatcher records every aten op (views, which launch no kernel, left out);
``keras.layers.Layer.__call__`` is counted the same way. The peak is the
bytes the inference forward allocates at once (``bench.memory.torch_peak_bytes``).
Random weights, no timing: the figures are exact and the same on every
machine. ``--gpu-form`` counts the packed blocks' GPU form
(``layers.packed_block.fuse_groups``) on any machine; ``--projections grouped_kernel`` the form
with each nested projection one Triton launch (``layers.packed_kernels``): its Triton launches
are counted, not run (their outputs are left unwritten; the counts do not depend on values)::

    KERAS_BACKEND=torch python bench/torch_op_count.py                 # ViT-B/16, e_c 0.3, one image
    KERAS_BACKEND=torch python bench/torch_op_count.py --gpu-form --batch-size 8
    KERAS_BACKEND=torch python bench/torch_op_count.py --gpu-form --projections grouped_kernel
    KERAS_BACKEND=torch python bench/torch_op_count.py --gpu-form --projections grouped_kernel \
        --precision mixed_bfloat16
    KERAS_BACKEND=torch python bench/torch_op_count.py --capacity 0.5 --variant S/16
"""

import argparse
import os

import keras
import numpy as np

from keras_mone.bench.memory import torch_peak_bytes
from keras_mone.bench.torch_ops import kernel_ops, layer_calls, record
from keras_mone.kernels import triton_grouped_tile, triton_row_statistics
from keras_mone.layers import packed_block, platform_forms
from keras_mone.models import MoNEViTBackbone, ViTBackbone
from keras_mone.models.variants import decode_variant


class TritonLaunches:
    """Stands in for the Triton kernels (``kernels.triton_grouped_tile.kernel``,
    ``kernels.triton_row_statistics._kernel``): counts each launch and runs nothing."""

    def __init__(self):
        self.launches = 0

    def __call__(self, interpret):
        return self

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs):
        self.launches += 1


def counts(model, x, triton=None):
    """``(kernel ops, layer calls, torch.compile graphs, peak MiB)`` of ``model(x)`` after one warm-up
    call (graphs: what dynamo captures; each graph break adds one, and the code between runs eagerly);
    the kernel ops include the launches ``triton`` (a ``TritonLaunches``) counted in one forward."""
    import torch

    model(x)
    with torch.no_grad():
        graphs = torch._dynamo.explain(lambda t: model(t))(x).graph_count
        peak = torch_peak_bytes(lambda: model(x)) / 2**20
        launched = triton.launches if triton else 0
        ops = kernel_ops(record(lambda: model(x))) + (triton.launches - launched if triton else 0)
        return ops, layer_calls(lambda: model(x)), graphs, peak


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="B/16")
    parser.add_argument("--capacity", type=float, default=0.3)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--gpu-form", action="store_true", help="the packed blocks' GPU form (fuse_groups)")
    parser.add_argument("--projections", default="per_group", choices=platform_forms.PROJECTIONS_FORMS,
                        help="$KERAS_MONE_PROJECTIONS: grouped_kernel counts the Triton launches, runs none")
    parser.add_argument("--precision", default="float32", choices=("float32", "mixed_bfloat16"),
                        help="the models' dtype policy")
    args = parser.parse_args(argv)
    if keras.backend.backend() != "torch":
        raise SystemExit("Run with KERAS_BACKEND=torch: the counts are torch's dispatcher's.")
    import torch

    config = dict(decode_variant(args.variant), image_size=args.image_size)
    size = args.image_size
    shape = (args.batch_size, size, size, 3)
    x = torch.as_tensor(np.random.default_rng(0).uniform(-1, 1, shape).astype("float32"))
    if args.gpu_form:
        packed_block.fuse_groups = lambda tensor: True
    os.environ[platform_forms.PROJECTIONS_ENV] = args.projections
    triton = None
    if args.projections == "grouped_kernel":
        triton = TritonLaunches()
        triton_grouped_tile.kernel = triton_row_statistics._kernel = triton
    rows = []
    config["dtype"] = args.precision
    mone = MoNEViTBackbone(**config, capacity=args.capacity)
    for name, model in (("dense", ViTBackbone(**config)), (f"mone e_c={args.capacity:g}", mone)):
        model.build()
        ops, calls, graphs, peak = counts(model, x, triton)
        rows.append(f"| {name} | {ops} | {calls} | {graphs} | {peak:.1f} |")
    form = "GPU" if packed_block.fuse_groups(keras.ops.convert_to_tensor(x)) else "CPU"  # on Keras' device
    print(f"ViT-{args.variant} at {args.image_size}, batch {args.batch_size}, {args.precision}, the packed blocks' "
          f"{form} form, projections {args.projections}, torch {torch.__version__}, keras {keras.__version__}\n")
    print("| model | kernel ops per forward | Keras layer calls | torch.compile graphs | peak forward MiB |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
