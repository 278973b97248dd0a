"""Routing maps and the router-score threshold sweep (MoNE Fig. 1 and Fig. 8).

For each image (each frame index of a clip) the map of where every token
went (MoNE's expert, MoD / A-MoD kept or skipped, ACM's learner count) beside
the router's score over the image; then Fig. 1's sweep: raising a threshold
on the scores sends fewer tokens to the full model. The thresholds are
quantiles of the scores pooled over the analysed set, so each image keeps
its own share of tokens above them: images the router finds busier keep more.
"""

import numpy as np

from keras_mone.analysis.token_maps import KINDS, frames_of, token_record

#: Shares of tokens above the threshold, pooled over the set (Fig. 1: left to right).
DEFAULT_FRACTIONS = (1.0, 0.75, 0.5, 0.25, 0.1)


def threshold_sweep(scores, fractions=DEFAULT_FRACTIONS):
    """Fig. 1's sweep: thresholds on ``scores`` ``(n, ...)`` keeping ``fractions`` of all tokens.

    Returns:
        dict: ``"fractions"`` (the pooled shares asked for), ``"thresholds"``
        (the ``1 - fraction`` quantiles of the pooled scores), ``"masks"`` bool
        ``(len(fractions), n, ...)`` (token score >= threshold: sent to the full
        model), ``"per_example"`` ``(len(fractions), n)`` each example's share
        of tokens above the threshold.
    """
    scores = np.asarray(scores, dtype="float64")
    fractions = [float(f) for f in fractions]
    if not fractions or any(not 0.0 < f <= 1.0 for f in fractions):
        raise ValueError(f"`fractions` must be shares in (0, 1], got {fractions!r}.")
    thresholds = [float(np.quantile(scores, 1.0 - f)) if f < 1.0 else float(scores.min()) for f in fractions]
    masks = np.stack([scores >= t for t in thresholds])
    per_example = masks.reshape(len(fractions), scores.shape[0], -1).mean(axis=-1)
    return {"fractions": fractions, "thresholds": thresholds, "masks": masks, "per_example": per_example}


def routing_maps(model, inputs, decision=None, fractions=DEFAULT_FRACTIONS, batch_size=128):
    """Routing maps, score maps and the threshold sweep of ``inputs`` (Fig. 1, Fig. 8).

    Args:
        model: a routed model (MoNE, MoD, A-MoD, ACM; image or video) at the
            capacity to show (``model.set_capacity``).
        inputs: model-ready images or clips.
        decision: which routing decision to draw (``token_record``).
        fractions: shares of tokens the sweep's thresholds keep.

    Returns:
        ``(record, sweep, summary)``: ``token_record``'s maps, the
        ``threshold_sweep`` of their scores, and a JSON-able summary (kind,
        share of tokens per assignment value, score statistics, thresholds
        with the mean and spread of each example's share above them).
    """
    record = token_record(model, inputs, decision=decision, batch_size=batch_size)
    sweep = threshold_sweep(record["score"], fractions)
    assignment = record["assignment"]
    values, counts = np.unique(np.round(assignment, 3), return_counts=True)
    score = record["score"]
    summary = {
        "kind": record["kind"],
        "map": KINDS[record["kind"]],
        "examples": int(len(inputs)),
        "map_shape": list(assignment.shape[1:]),
        "token_share_by_assignment": {f"{v:g}": float(c / counts.sum()) for v, c in zip(values, counts)},
        "mean_compute_share": float(record["compute"].mean()),
        "score": {"min": float(score.min()), "mean": float(score.mean()), "max": float(score.max())},
        "sweep": [
            {"fraction": f, "threshold": t, "mean_share": float(p.mean()), "std_share": float(p.std()),
             "min_share": float(p.min()), "max_share": float(p.max())}
            for f, t, p in zip(sweep["fractions"], sweep["thresholds"], sweep["per_example"])
        ],
    }
    return record, sweep, summary


def _shown(image):
    return np.clip((np.asarray(image, dtype="float32") + 1) / 2, 0, 1)


def _panels(inputs, record, backbone, num_images):
    """``(label, image, assignment, score, index)`` per drawn panel row; clips give one row per
    frame index of their first clip(s)."""
    rows = []
    if record["assignment"].ndim == 3:
        for i in range(min(num_images, len(inputs))):
            rows.append((f"image {i}", inputs[i], record["assignment"][i], record["score"][i], (i,)))
        return rows
    frames = frames_of(inputs, backbone)
    for clip in range(len(inputs)):
        for f in range(frames.shape[1]):
            if len(rows) == num_images:
                return rows
            rows.append((f"clip {clip} frame {f}", frames[clip, f], record["assignment"][clip, f],
                         record["score"][clip, f], (clip, f)))
    return rows


def plot_routing_maps(model, inputs, record, sweep, num_images=4):
    """One row per image (per frame index of the first clip): the input, its routing map,
    the router's score map, then the input with the tokens above each sweep threshold
    (the rest greyed). Returns the ``matplotlib`` figure."""
    from matplotlib.figure import Figure

    backbone = getattr(model, "backbone", model)
    rows = _panels(np.asarray(inputs), record, backbone, num_images)
    columns = 3 + len(sweep["fractions"])
    fig = Figure(figsize=(1.7 * columns, 1.8 * len(rows) + 0.4))
    axes = fig.subplots(len(rows), columns, squeeze=False)
    low, high = np.min(record["assignment"]), np.max(record["assignment"])
    for r, (label, image, assignment, score, index) in enumerate(rows):
        shown = _shown(image)
        extent = (0, shown.shape[1], shown.shape[0], 0)
        axes[r, 0].imshow(shown)
        axes[r, 0].set_ylabel(label, fontsize=7)
        axes[r, 1].imshow(assignment, cmap="viridis", vmin=low, vmax=high, extent=extent, interpolation="nearest")
        axes[r, 2].imshow(score, cmap="magma", extent=extent, interpolation="nearest")
        for c, (fraction, masks) in enumerate(zip(sweep["fractions"], sweep["masks"])):
            keep = np.kron(masks[index], np.ones((shown.shape[0] // masks[index].shape[0],
                                                  shown.shape[1] // masks[index].shape[1])))
            axes[r, 3 + c].imshow(np.where(keep[..., None] > 0, shown, 0.35 + 0.4 * shown))  # others greyed
            if r == 0:
                axes[r, 3 + c].set_title(f"top {100 * fraction:g}%", fontsize=8)
    if rows:
        axes[0, 0].set_title("input", fontsize=8)
        axes[0, 1].set_title(f"{record['kind']} map", fontsize=8)
        axes[0, 2].set_title("router score", fontsize=8)
    for ax in axes.ravel():
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"{KINDS[record['kind']]}; sweep: tokens above pooled score quantiles", fontsize=8)
    fig.tight_layout()
    return fig
