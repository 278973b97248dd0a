"""Figures of the quickstart: accuracy against GMACs, and routed tokens on images."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402


def plot_accuracy_vs_gmacs(results, path):
    """MoNE at each evaluated capacity against the dense model."""
    fig, ax = plt.subplots(figsize=(5, 4))
    mone = sorted(results["mone"], key=lambda r: r["gmacs"])
    ax.plot(
        [r["gmacs"] * 1e3 for r in mone], [100 * r["accuracy"] for r in mone], "o-",
        label="MoNE-ViT (one model)",
    )
    for r in mone:
        ax.annotate(f"e_c={r['capacity']:g}", (r["gmacs"] * 1e3, 100 * r["accuracy"]),
                    textcoords="offset points", xytext=(4, -10), fontsize=8)
    dense = results["dense"]
    ax.plot([dense["gmacs"] * 1e3], [100 * dense["accuracy"]], "s", color="black", label="dense ViT")
    ax.set_xlabel("MMACs per image")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Cluttered digits")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_routing(model, test_data, path, num_images=8):
    """Test images with the tokens routed to the full expert highlighted."""
    images = test_data[0][:num_images]
    backbone = model.backbone
    _, intermediates = backbone(images, return_intermediates=True)
    expert = ops.convert_to_numpy(intermediates["expert_index"][0])
    if backbone.use_class_token:
        expert = expert[:, 1:]
    grid = backbone.patch_embedding.grid_size
    full = (expert == backbone.num_experts - 1).reshape(-1, *grid)
    patch_size = backbone.patch_size
    fig, axes = plt.subplots(2, num_images, figsize=(1.6 * num_images, 3.4))
    for i in range(num_images):
        shown = (images[i] + 1) / 2
        axes[0, i].imshow(np.clip(shown, 0, 1))
        overlay = np.kron(full[i], np.ones((patch_size, patch_size)))
        axes[1, i].imshow(np.clip(shown, 0, 1) * (0.25 + 0.75 * overlay[..., None]))
        for ax in axes[:, i]:
            ax.set_xticks([])
            ax.set_yticks([])
    axes[0, 0].set_ylabel("input")
    axes[1, 0].set_ylabel("full expert")
    fig.suptitle(f"Tokens routed to the full expert at e_c = {backbone.capacity:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
