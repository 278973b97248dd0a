"""Host time of an eager torch forward: what the CPU spends per call before any kernel runs.

On a GPU an eager torch forward is bounded by the host wherever its ops are
issued more slowly than the card runs them: small batches, or a MoNE model's
narrow groups (issue 40 item 3). Here the models keep ViT-B/16's depth
and routing but have tiny widths and images (``--hidden-dim 16``, 64 pixels: 16
tokens), so the arithmetic is negligible and the time per call is the host's: Keras' layer calls and op
dispatch, torch's dispatcher, the routing's Python. A plain PyTorch ViT of the
same shape (``nn.Linear``, ``nn.LayerNorm``, SDPA; written here, not timm's) is
the floor an eager torch model pays. One thread, inference mode, medians of
interleaved calls; the figures are this machine's, so quote the ratios. The models run
on Keras' torch device: on a GPU machine set ``KERAS_TORCH_DEVICE=cpu`` for the host's
share alone (``bench/gpu.sh`` does), or leave it for the card, each call synchronised::

    KERAS_BACKEND=torch python bench/torch_host_time.py
    KERAS_BACKEND=torch python bench/torch_host_time.py --capacity 0.5 --repeats 60
"""

import argparse
import time

import keras
import numpy as np

from keras_mone.models import MoNEViTBackbone, ViTBackbone
from keras_mone.models.variants import decode_variant


def plain_torch_vit(depth, hidden_dim, num_heads, mlp_dim, image_size, patch_size):
    """A pre-LayerNorm ViT backbone in plain PyTorch modules (learned positions, no class token: as
    ``ViTBackbone``'s default)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(hidden_dim, eps=1e-6), nn.LayerNorm(hidden_dim, eps=1e-6)
            self.qkv, self.out = nn.Linear(hidden_dim, 3 * hidden_dim), nn.Linear(hidden_dim, hidden_dim)
            self.fc1, self.fc2 = nn.Linear(hidden_dim, mlp_dim), nn.Linear(mlp_dim, hidden_dim)

        def forward(self, x):
            batch, tokens, _ = x.shape
            qkv = self.qkv(self.norm1(x)).reshape(batch, tokens, 3, num_heads, -1).permute(2, 0, 3, 1, 4)
            attended = nn.functional.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
            x = x + self.out(attended.transpose(1, 2).reshape(batch, tokens, hidden_dim))
            return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))

    class Backbone(nn.Module):
        def __init__(self):
            super().__init__()
            self.patches = nn.Conv2d(3, hidden_dim, patch_size, patch_size)
            self.positions = nn.Parameter(torch.zeros(1, (image_size // patch_size) ** 2, hidden_dim))
            self.blocks = nn.Sequential(*[Block() for _ in range(depth)])
            self.norm = nn.LayerNorm(hidden_dim, eps=1e-6)

        def forward(self, images):  # (batch, height, width, 3), as the Keras models take them
            x = self.patches(images.permute(0, 3, 1, 2)).flatten(2).transpose(1, 2) + self.positions
            return self.norm(self.blocks(x))

    return Backbone().eval()


def host_times(models, images, repeats, warmup=3):
    """``{name: [seconds per forward]}``, the models called round-robin under ``torch.inference_mode``
    (on a CUDA device each call is synchronised: the time until its results exist)."""
    import torch

    def synchronise():
        if images.device.type == "cuda":
            torch.cuda.synchronize(images.device)

    times = {name: [] for name in models}
    with torch.inference_mode():
        for model in models.values():
            for _ in range(warmup):
                model(images)
        for _ in range(repeats):
            for name, model in models.items():
                synchronise()
                started = time.perf_counter()
                model(images)
                synchronise()
                times[name].append(time.perf_counter() - started)
    return times


def report(times, reference="dense"):
    """Markdown rows: median and interquartile range in ms, and each median over ``reference``'s."""
    base = np.median(times[reference])
    lines = ["| model | host ms per forward (median) | IQR ms | against dense |", "|---|---|---|---|"]
    for name, samples in times.items():
        q1, median, q3 = np.percentile(samples, [25, 50, 75]) * 1e3
        lines.append(f"| {name} | {median:.2f} | {q3 - q1:.2f} | {median / 1e3 / base:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="B/16", help="depth, heads and patch size come from it")
    parser.add_argument("--hidden-dim", type=int, default=16, help="tiny, with the image size: the arithmetic vanishes")
    parser.add_argument("--image-size", type=int, default=64, help="small: 16 tokens, the arithmetic vanishes")
    parser.add_argument("--capacity", type=float, default=0.3)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if keras.backend.backend() != "torch":
        raise SystemExit("Run with KERAS_BACKEND=torch: this times torch's eager forward.")
    import torch

    torch.set_num_threads(args.threads)
    size = decode_variant(args.variant)
    heads = min(size["num_heads"], args.hidden_dim // 8) or 1
    config = dict(size, hidden_dim=args.hidden_dim, num_heads=heads, mlp_dim=4 * args.hidden_dim,
                  image_size=args.image_size)
    dense, mone = ViTBackbone(**config), MoNEViTBackbone(**config, capacity=args.capacity)
    for model in (dense, mone):
        model.build()
    plain = plain_torch_vit(config["depth"], args.hidden_dim, heads, 4 * args.hidden_dim, args.image_size,
                            config["patch_size"])
    shape = (args.batch_size, args.image_size, args.image_size, 3)
    # on Keras' torch device (``$KERAS_TORCH_DEVICE``, else a GPU where there is one), the plain ViT too
    images = keras.ops.convert_to_tensor(np.random.default_rng(0).uniform(-1, 1, shape).astype("float32"))
    plain = plain.to(images.device)
    models = {"dense": dense, f"mone e_c={args.capacity:g}": mone, "plain PyTorch ViT (same shape)": plain}
    times = host_times(models, images, args.repeats)
    tokens = (args.image_size // config["patch_size"]) ** 2
    print(f"ViT-{args.variant}'s depth and routing at {args.image_size}px ({tokens} tokens), hidden {args.hidden_dim}, "
          f"{heads} heads, "
          f"batch {args.batch_size}, on {images.device}, eager torch {torch.__version__}, keras {keras.__version__}, "
          f"{args.threads} thread(s), {args.repeats} interleaved calls each, {time.strftime('%Y-%m-%d')}\n")
    print(report(times))


if __name__ == "__main__":
    main()
