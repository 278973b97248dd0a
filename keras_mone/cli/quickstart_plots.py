"""Figures of the quickstart: accuracy against GMACs, and routed tokens on images."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


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
    """Test images over their routing map (``keras_mone.analysis.plot_routing``)."""
    from keras_mone.analysis.routing_plot import plot_routing as draw

    draw(model, test_data[0], path, num_images)
