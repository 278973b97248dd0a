"""Leave-one-out token importance against the router's score (does the router find the tokens that matter?).

A token's importance is how much the loss rises when the token is *removed*:
the image's embedded tokens (patch embedding and positions) go through the
encoder with that one token left out of the sequence, so nothing of it is
attended to, pooled or routed. Removal rather than zeroing: a zeroed token
(or a zero, i.e. mid-grey, patch) is still a token, attended to, routed and
averaged by the pooling, with a content the model never saw in training, so
its loss change mixes the token's absence with an out-of-distribution input.
Every routed method here handles a sequence one token shorter (EPR's
per-expert counts follow the length; MoD keeps its ``k``), so the removed
model is the same model on ``N - 1`` tokens. Other tokens may move between
experts when one leaves; that is part of the effect measured.

The router's score is ``token_record``'s (MoNE the full expert's
probability, MoD its router output, A-MoD received attention, ACM the gate's
expected learner count); agreement is Spearman's rank correlation per image
and pooled over all tokens of the set.
"""

import numpy as np
from keras import ops

from keras_mone.analysis.token_maps import cross_entropy, padded_batches, spearman, token_record


def _without_each_token(tokens, leading):
    """``(m, P, T - 1, D)``: for each of the ``P = T - leading`` patch tokens, the sequence without it
    (leading tokens, e.g. a class token, are never removed)."""
    total = tokens.shape[1]
    keep = np.array([[t for t in range(total) if t != leading + j] for j in range(total - leading)])
    return tokens[:, keep]


def _logits(model, tokens):
    backbone = model.backbone
    # encode is called directly (the token count varies), so the backend tensor is made here
    encoded, _ = backbone.encode(ops.convert_to_tensor(tokens), training=False)
    return ops.convert_to_numpy(model.logits(backbone.output_tokens(encoded, training=False), training=False))


def leave_one_out(model, images, labels, images_per_pass=16):
    """``(importance, full_loss)``: the loss rise when each patch token is removed, ``(n, gh, gw)``
    float64, and the loss with every token, ``(n,)``, at the model's current capacity.

    Args:
        model: an image classifier of the ViT family (``model.logits`` on the
            backbone's encoded tokens): dense, MoNE, MoD, A-MoD, ACM.
        images: model-ready images ``(n, H, W, C)``.
        labels: integer classes ``(n,)``.
        images_per_pass: images whose ``P`` one-token-shorter sequences go
            through the encoder together (``P`` sequences each).
    """
    backbone = getattr(model, "backbone", None)
    images = np.asarray(images)
    if backbone is None or not hasattr(model, "logits") or not hasattr(backbone, "encode") or images.ndim != 4:
        raise ValueError(
            "Leave-one-out needs an image classifier of the ViT family (a backbone with `encode` and a "
            f"`logits` head) and images (n, H, W, C); got {type(model).__name__} with inputs {images.shape}."
        )
    grid = tuple(backbone.patch_embedding.grid_size)
    leading = backbone.num_tokens - grid[0] * grid[1]
    labels = np.asarray(labels).astype(int)
    importance, full = [], []
    start = 0
    for batch, count in padded_batches(images, images_per_pass):
        tokens = ops.convert_to_numpy(backbone.patch_embedding(batch))
        variants = _without_each_token(tokens, leading)
        m, patches = variants.shape[:2]
        logits = _logits(model, variants.reshape(m * patches, *variants.shape[2:])).reshape(m, patches, -1)
        y = labels[start:start + m] if count == m else np.concatenate(
            [labels[start:start + count], np.repeat(labels[start + count - 1:start + count], m - count)]
        )
        base = cross_entropy(_logits(model, tokens), y)
        removed = cross_entropy(logits, np.repeat(y[:, None], patches, axis=1))
        importance.append((removed - base[:, None])[:count])
        full.append(base[:count])
        start += count
    return np.concatenate(importance).reshape(len(images), *grid), np.concatenate(full)


def importance_vs_score(model, images, labels, decision=None, images_per_pass=16, batch_size=128):
    """Leave-one-out importance against the router's score, per image and over the set.

    Returns:
        ``(importance, score, summary)``: maps ``(n, gh, gw)`` and a JSON-able
        summary: Spearman per image (mean, spread, share of positive), pooled
        over every token of the set, the same for the importance's magnitude
        ``|loss change|`` (a distractor whose removal lowers the loss still
        matters to the model), and the overlap of the quarter of tokens most
        important with the quarter scored highest (0.25 by chance).
    """
    importance, full_loss = leave_one_out(model, images, labels, images_per_pass)
    record = token_record(model, images, decision=decision, batch_size=batch_size)
    score = record["score"]
    flat_i = importance.reshape(len(images), -1)
    flat_s = score.reshape(len(images), -1)
    per_image = np.array([spearman(i, s) for i, s in zip(flat_i, flat_s)])
    valid = per_image[~np.isnan(per_image)]
    magnitude = np.array([spearman(np.abs(i), s) for i, s in zip(flat_i, flat_s)])
    magnitude = magnitude[~np.isnan(magnitude)]
    quarter = max(1, flat_i.shape[1] // 4)
    top_i = np.argsort(-flat_i, axis=1, kind="mergesort")[:, :quarter]
    top_s = np.argsort(-flat_s, axis=1, kind="mergesort")[:, :quarter]
    overlap = np.mean([len(set(a) & set(b)) / quarter for a, b in zip(top_i, top_s)])
    summary = {
        "kind": record["kind"],
        "removal": "token left out of the embedded sequence (not zeroed)",
        "examples": int(len(images)),
        "tokens_per_example": int(flat_i.shape[1]),
        "spearman_per_image_mean": float(valid.mean()) if len(valid) else None,
        "spearman_per_image_std": float(valid.std()) if len(valid) else None,
        "spearman_per_image_positive_share": float((valid > 0).mean()) if len(valid) else None,
        "spearman_pooled": spearman(flat_i, flat_s),
        "spearman_magnitude_per_image_mean": float(magnitude.mean()) if len(magnitude) else None,
        "spearman_magnitude_pooled": spearman(np.abs(flat_i), flat_s),
        "top_quarter_overlap": float(overlap),
        "top_quarter_overlap_by_chance": quarter / flat_i.shape[1],
        "mean_full_loss": float(full_loss.mean()),
        "mean_importance": float(importance.mean()),
        "per_image_spearman": [None if np.isnan(v) else float(v) for v in per_image],
    }
    return importance, score, summary


def plot_importance(images, importance, score, summary, num_images=4):
    """Per image: input, leave-one-out importance map, router score map; then the per-image
    Spearman histogram. Returns the ``matplotlib`` figure."""
    from matplotlib.figure import Figure

    shown = min(num_images, len(images))
    fig = Figure(figsize=(6.0, 1.8 * shown + 2.2))
    grid = fig.add_gridspec(shown + 1, 3)
    for r in range(shown):
        image = np.clip((np.asarray(images[r]) + 1) / 2, 0, 1)
        extent = (0, image.shape[1], image.shape[0], 0)
        rho = summary["per_image_spearman"][r]
        for c, (panel, title) in enumerate(((image, "input"), (importance[r], "leave-one-out"), (score[r], "router score"))):
            ax = fig.add_subplot(grid[r, c])
            ax.imshow(panel, **({} if c == 0 else {"extent": extent, "interpolation": "nearest", "cmap": "magma"}))
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(title, fontsize=8)
        fig.axes[-3].set_ylabel("rho n/a" if rho is None else f"rho {rho:.2f}", fontsize=7)
    ax = fig.add_subplot(grid[shown, :])
    values = [v for v in summary["per_image_spearman"] if v is not None]
    ax.hist(values, bins=20, range=(-1, 1))
    ax.set_xlabel("Spearman(leave-one-out importance, router score) per image")
    mean = summary["spearman_per_image_mean"]
    ax.set_title(f"mean {float('nan') if mean is None else mean:.3f}, pooled "
                 f"{summary['spearman_pooled']:.3f}", fontsize=8)
    fig.tight_layout()
    return fig
