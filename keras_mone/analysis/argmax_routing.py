"""Argmax routing without capacity limits: does the router's compute rank image difficulty? (MoNE App. A.3, Fig. 11)

Instead of Expert Preferred Routing under capacities, every token goes to its
most probable expert (ACM: its most probable learner count); the compute an
image would then take, the mean share of the full width over its tokens, is
the router's verdict on how hard the image is. The paper shows the images it
ranks lowest and highest (Fig. 11); here the verdict is also set against the
model's per-image loss with Spearman's rank correlation (positive: the
router spends more on the images the model finds harder).
"""

import numpy as np

from keras_mone.analysis.token_maps import per_example_loss, spearman, token_record


def argmax_compute(model, inputs, decision=None, batch_size=128):
    """``(per_example, per_token)``: the share of the full width each example ``(n,)`` and each
    patch token ``(n, [frames,] gh, gw)`` would run at under argmax routing.

    MoNE: the width ``d_e / D`` of each token's most probable expert at router
    ``decision`` (default the first; the paper's routers sit at block 0, whose
    scores do not depend on the capacity). ACM: ``k / N`` of each gate's most
    probable learner count, mean over blocks (or block ``decision``). MoD /
    A-MoD choose nothing per token (top-k of a score), so they raise.
    """
    record = token_record(model, inputs, decision=decision, batch_size=batch_size)
    if record["argmax_share"] is None:
        raise ValueError(
            f"Argmax routing needs a per-token choice among experts or learner counts (MoNE, ACM); "
            f"this model's routing is {record['kind']!r} (top-k token skipping: a score that only ranks "
            "tokens, with nothing to take the argmax over)."
        )
    per_token = record["argmax_share"]
    return per_token.reshape(len(per_token), -1).mean(axis=1), per_token


def argmax_difficulty(model, inputs, labels, decision=None, batch_size=128, top=3):
    """Argmax-routing compute per example against the model's loss per example.

    The loss is the model's own at its current capacity (``set_capacity``,
    EPR as trained). Returns a JSON-able summary: Spearman's rank
    correlation of compute and loss (and of compute and error), mean compute
    of correct and wrong examples, the share of tokens per argmax choice, and
    the ``top`` examples ranked lowest and highest; plus ``"compute"`` and
    ``"loss"`` lists per example for plotting.
    """
    compute, per_token = argmax_compute(model, inputs, decision, batch_size)
    loss, predicted = per_example_loss(model, inputs, labels, batch_size)
    wrong = predicted != np.asarray(labels).astype(int)
    order = np.argsort(compute, kind="mergesort")
    values, counts = np.unique(np.round(per_token, 4), return_counts=True)
    return {
        "examples": int(len(compute)),
        "spearman_compute_loss": spearman(compute, loss),
        "spearman_compute_error": spearman(compute, wrong.astype(float)) if 0 < wrong.sum() < len(wrong) else None,
        "mean_compute": float(compute.mean()),
        "mean_compute_correct": float(compute[~wrong].mean()) if (~wrong).any() else None,
        "mean_compute_wrong": float(compute[wrong].mean()) if wrong.any() else None,
        "error_rate": float(wrong.mean()),
        "token_share_by_width": {f"{v:g}": float(c / counts.sum()) for v, c in zip(values, counts)},
        "lowest": [int(i) for i in order[:top]],
        "highest": [int(i) for i in order[::-1][:top]],
        "compute": [float(c) for c in compute],
        "loss": [float(v) for v in loss],
    }


def plot_argmax_difficulty(inputs, summary, num_shown=3):
    """Fig. 11 at this scale: the ``num_shown`` examples with the lowest and highest argmax
    compute (first frame for clips), and argmax compute against loss (log scale).
    Returns the ``matplotlib`` figure."""
    from matplotlib.figure import Figure

    inputs = np.asarray(inputs)
    fig = Figure(figsize=(2.0 * num_shown + 4.5, 4.2))
    grid = fig.add_gridspec(2, num_shown + 2)
    compute, loss = np.asarray(summary["compute"]), np.asarray(summary["loss"])
    for row, name in enumerate(("lowest", "highest")):
        for col, index in enumerate(summary[name][:num_shown]):
            ax = fig.add_subplot(grid[row, col])
            image = inputs[index][0] if inputs.ndim == 5 else inputs[index]
            ax.imshow(np.clip((image + 1) / 2, 0, 1))
            ax.set_title(f"{name} #{index}\ncompute {compute[index]:.2f}", fontsize=7)
            ax.set_xticks([])
            ax.set_yticks([])
    ax = fig.add_subplot(grid[:, num_shown:])
    ax.scatter(compute, np.maximum(loss, 1e-6), s=4, alpha=0.4)
    ax.set_yscale("log")
    ax.set_xlabel("argmax-routing compute (share of full width)")
    ax.set_ylabel("per-example loss")
    ax.set_title(f"Spearman {summary['spearman_compute_loss']:.3f} over {summary['examples']} examples", fontsize=8)
    fig.tight_layout()
    return fig
