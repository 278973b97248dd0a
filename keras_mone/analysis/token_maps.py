"""Per-token routing of any routed method, read from one forward record, in numpy.

Every routed backbone of the zoo records its decisions in the same form
(``return_intermediates=True``, ``keras_mone.models.block_loop.BlockRecord``):
MoNE the router probabilities and expert of every token (Sec. 3.2, EPR), MoD /
A-MoD the score and the kept tokens of each routed block, ACM the learner
count each block's gate picked. ``token_record`` turns that into maps over the
patch grid (per frame index for video) that the routing analyses share.
"""

import numpy as np
from keras import ops

from keras_mone.models.record_call import forward_with_record
from keras_mone.routing.capacity import expert_width_fractions

#: What the routing map of each kind holds (``register_record_kind`` adds a kind).
KINDS = {}
#: ``kind -> (marker, reader)``, in the order kinds are recognised.
_READERS = {}


def register_record_kind(kind, marker, description):
    """Decorator registering a routed method's reader of its forward record.

    ``marker``: a record key only that method's forward pass writes (the
    record is recognised as ``kind`` when it holds it, kinds tried in
    registration order); ``description``: what its routing map holds
    (``KINDS``). The reader ``fn(record, decision) -> (assignment, score,
    probs, argmax_share)`` returns numpy arrays ``(rows, tokens)`` (``probs``
    ``(rows, tokens, choices)`` or ``None``, ``argmax_share`` or ``None``).
    MoNE's and MoD's kinds are read here, from the shared routing parts'
    fields; ACM registers its own (``keras_mone.methods.acm.record``)."""

    def decorator(reader):
        KINDS[kind] = description
        _READERS[kind] = (marker, reader)
        return reader

    return decorator


def method_kind(record):
    """The registered kind of a forward record (``"expert"``: MoNE, ``"kept"``: MoD and A-MoD,
    ``"learners"``: ACM); a ``ValueError`` for models that route nothing (dense, MatViT, Mixer)."""
    for kind, (marker, _) in _READERS.items():
        if marker in record:
            return kind
    raise ValueError(
        "The model routes no tokens (no router, token skipping or ACM gate in its forward record), "
        "so it has no routing map: use a MoNE, MoD, A-MoD or ACM model (MatViT runs every token at "
        "one width; its `set_width` is the whole story)."
    )


def _decision(record, kind, decision):
    """``(assignment, score, probs, argmax_share)`` of the ``kind`` reader."""
    return _READERS[kind][1](record, decision)


@register_record_kind("expert", "router_probs", "nested expert of each token (0 smallest, E-1 full, -1 dropped)")
def _expert_decision(record, decision):
    """MoNE: router ``decision``'s expert per token, full-expert probability, probabilities over
    experts and the argmax expert's width (``routing.parts.NestedExperts``' record)."""
    count = len(record["router_probs"])
    index = 0 if decision is None else decision
    if not 0 <= index < count:
        raise ValueError(f"`decision` must be a router index in [0, {count}), got {decision!r}.")
    probs = ops.convert_to_numpy(record["router_probs"][index]).astype("float32")
    widths = np.asarray(expert_width_fractions(probs.shape[-1]), dtype="float32")
    return ops.convert_to_numpy(record["expert_index"][index]), probs[..., -1], probs, widths[probs.argmax(-1)]


@register_record_kind("kept", "selected", "1 where the routed block runs the token, 0 where it skips it")
def _kept_decision(record, decision):
    """MoD / A-MoD: routed block ``decision``'s kept tokens and scores (``routing.parts.TopKSkip``)."""
    routed = [entry for entry in record["blocks"] if "scores" in entry]
    index = 0 if decision is None else decision
    if not 0 <= index < len(routed):
        raise ValueError(f"`decision` must be a routed-block index in [0, {len(routed)}), got {decision!r}.")
    entry = routed[index]
    kept = (ops.convert_to_numpy(entry["assignment"]) >= 0).astype("int32")
    return kept, ops.convert_to_numpy(entry["scores"]).astype("float32"), None, None


def token_record(model, inputs, decision=None, batch_size=128):
    """The routing of every patch token of ``inputs`` at the model's current capacity.

    Args:
        model: a routed classifier or backbone (MoNE, random-router MoNE,
            MoD, A-MoD, ACM; image or video).
        inputs: model-ready images ``(n, H, W, C)`` or clips ``(n, T, H, W, C)``.
        decision: which routing decision to read: MoNE's router index
            (default 0, the first router), the MoD / A-MoD routed block in
            order (default the first), the ACM block (default: mean over blocks).
        batch_size: examples per forward pass.

    Returns:
        dict of numpy arrays over the patch grid, ``(n, gh, gw)`` for images
        and ``(n, T/t, gh, gw)`` for clips (class tokens dropped):
        ``"assignment"`` (see ``KINDS[kind]``), ``"score"`` (the router's score
        of each token: MoNE the full expert's probability, which EPR fills
        first; MoD the router output; A-MoD the attention the token received;
        ACM the gate's expected learner count), ``"compute"`` (the token's share
        of the full width, mean over blocks: its implied compute), ``"probs"``
        (MoNE / ACM gate probabilities, last axis experts / counts, else
        ``None``), ``"argmax_share"`` (the share of the full width the token
        would run at if it went to its most probable choice without capacity
        limits, MoNE App. A.3: MoNE the argmax expert's width ``d_e / D``, ACM
        the argmax learner count ``k / N``; ``None`` for MoD / A-MoD, whose
        score ranks tokens but chooses nothing per token); and ``"kind"``.
    """
    backbone = getattr(model, "backbone", model)
    inputs = np.asarray(inputs)
    if len(inputs.shape) not in (4, 5):
        raise ValueError(f"`inputs` must be images (n, H, W, C) or clips (n, T, H, W, C), got {inputs.shape}.")
    grid = tuple(backbone.patch_embedding.grid_size)
    patches = grid[0] * grid[1]
    parts = {"assignment": [], "score": [], "compute": [], "probs": [], "argmax_share": []}
    kind = None
    frames = (backbone.num_frame_indices,) if len(inputs.shape) == 5 else ()
    rows_per_example = frames[0] if frames else 1
    for batch, count in padded_batches(inputs, batch_size):
        _, record = forward_with_record(backbone, batch)
        kind = method_kind(record)
        assignment, score, probs, argmax_share = _decision(record, kind, decision)
        compute = np.mean([ops.convert_to_numpy(b["compute"]) for b in record["blocks"]], axis=0)
        for name, value in zip(parts, (assignment, score, compute, probs, argmax_share)):
            if value is not None:
                value = value[: count * rows_per_example, value.shape[1] - patches:]
            parts[name].append(value)
    out = {"kind": kind}
    for name, values in parts.items():
        if values[0] is None:
            out[name] = None
            continue
        value = np.concatenate(values)
        out[name] = value.reshape(len(inputs), *frames, *grid, *value.shape[2:])
    return out


def padded_batches(inputs, batch_size):
    """``(batch, count)`` over ``inputs``: the last batch is padded (its last example repeated) to
    ``batch_size`` when there are several, so one traced shape serves them all; ``count`` is real."""
    for start in range(0, len(inputs), batch_size):
        batch = inputs[start:start + batch_size]
        count = len(batch)
        if count < batch_size and len(inputs) > batch_size:
            batch = np.concatenate([batch, np.repeat(batch[-1:], batch_size - count, axis=0)])
        yield batch, count


def frames_of(inputs, backbone):
    """The frame shown for each frame index of clips ``(n, T, ...)``: its tubelet's first frame."""
    step = backbone.num_frames // backbone.num_frame_indices
    return np.asarray(inputs)[:, ::step]


def rank(values):
    """Ranks 1..n of ``values`` with ties given their mean rank (Spearman's convention)."""
    values = np.asarray(values, dtype="float64").ravel()
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(1, len(values) + 1)
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    return (np.bincount(inverse, weights=ranks) / counts)[inverse]


def spearman(a, b):
    """Spearman's rank correlation of ``a`` and ``b`` (Pearson's of their tie-averaged ranks);
    ``nan`` when either is constant."""
    ra, rb = rank(a), rank(b)
    if len(ra) != len(rb):
        raise ValueError(f"`a` and `b` must have the same size, got {len(ra)} and {len(rb)}.")
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = np.sqrt((ra ** 2).sum() * (rb ** 2).sum())
    return float((ra * rb).sum() / denominator) if denominator > 0 else float("nan")


def per_example_loss(model, inputs, labels, batch_size=128):
    """``(loss, predicted)``: softmax cross-entropy of every example at the model's current
    capacity, float64 ``(n,)``, and its predicted class ``(n,)``."""
    logits = np.asarray(model.predict(inputs, batch_size=batch_size, verbose=0), dtype="float64")
    return cross_entropy(logits, labels), logits.argmax(-1)


def cross_entropy(logits, labels):
    """Softmax cross-entropy of ``logits`` ``(..., classes)`` at integer ``labels`` ``(...)``, float64."""
    logits = np.asarray(logits, dtype="float64")
    logits = logits - logits.max(axis=-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    labels = np.asarray(labels).astype(int)
    return -np.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
