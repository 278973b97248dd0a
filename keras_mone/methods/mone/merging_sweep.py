"""The token-merging sweep of a trained model (MoNE App. A.2, Fig. 10): accuracy against GMACs, with and without ToMe.

The merging itself is ``keras_mone.routing.token_merging``; this module runs models with it.

``merging_tokens(model, merges)`` is a context in which ``model`` (a dense
ViT or a MoNE-ViT classifier) merges tokens as
``keras_mone.routing.token_merging.MergedTokens`` describes: ``merges =
{block: r}`` removes ``r`` tokens right before each listed block, all before
the model's first router. Inside it ``predict`` / ``evaluate`` and
``keras_mone.flops`` follow the merged plan (compiled functions are kept per
plan, as per capacity); on exit the model is as before.
``token_merging_sweep`` scores a model over merge schedules and capacities.
"""

import contextlib

import numpy as np

from keras_mone.analysis.flops import flops
from keras_mone.methods.mone.backbone import MoNEViTBackbone
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.routing.token_merging import MergedTokens, merge_macs


def _backbone(model):
    backbone = getattr(model, "backbone", model)
    if not (type(backbone) is ViTBackbone or isinstance(backbone, MoNEViTBackbone)):
        raise ValueError(
            f"token merging: needs a dense ViT or MoNE-ViT (image) classifier, got {type(backbone).__name__}."
        )
    return backbone


def check_merges(model, merges):
    """``merges`` as ``{block: r}`` after checking them against ``model``; raises ``ValueError`` naming the problem."""
    backbone = _backbone(model)
    merges = {int(k): int(v) for k, v in dict(merges).items() if int(v)}
    first_router = min(getattr(backbone, "router_positions", [backbone.depth]))
    late = [index for index in merges if index > first_router]
    if late:
        raise ValueError(
            f"`merges`: blocks {late} come after the model's first router (block {first_router}); "
            f"merge only before it (blocks 0..{first_router})."
        )
    if any(r < 0 for r in merges.values()):
        raise ValueError(f"`merges`: token counts must be >= 0, got {merges}.")
    return merges


@contextlib.contextmanager
def merging_tokens(model, merges):
    """Context: ``model`` merges tokens before the blocks in ``merges`` (``{block: r}``)."""
    backbone = _backbone(model)
    merges = check_merges(model, merges)
    own_routing, own_key = backbone.token_routing, backbone.routing_key
    protected = 1 if backbone.use_class_token else 0
    backbone.__dict__["token_routing"] = lambda: MergedTokens(own_routing(), merges, protected)
    backbone.__dict__["routing_key"] = lambda: ("tome", tuple(sorted(merges.items())), own_key())
    try:
        yield model
    finally:
        del backbone.__dict__["token_routing"]
        del backbone.__dict__["routing_key"]


def merged_gmacs(model, merges):
    """GMACs per example of ``model`` with ``merges`` (the similarity products included)."""
    backbone = _backbone(model)
    with merging_tokens(model, merges):
        count = flops(model).gmacs
    return count + merge_macs(backbone.num_tokens, backbone.hidden_dim, merges, int(backbone.use_class_token)) / 1e9


def token_merging_sweep(model, images, labels, schedules, capacities=(None,), batch_size=256):
    """Accuracy and GMACs of ``model`` for each merge schedule (``{}`` = no merging) at each capacity.

    Returns a list of dicts: ``capacity``, ``merges``, ``tokens_after`` (tokens the blocks after
    the last merge run on), ``accuracy``, ``gmacs``. The model's capacity is restored afterwards.
    """
    backbone = _backbone(model)
    restore = getattr(model, "capacity", None)
    labels = np.asarray(labels)
    rows = []
    for capacity in capacities:
        if capacity is not None:
            model.set_capacity(capacity)
        for schedule in schedules:
            merges = check_merges(model, schedule)
            with merging_tokens(model, merges):
                logits = model.predict(images, batch_size=batch_size, verbose=0)
            rows.append(dict(
                capacity=None if capacity is None else float(model.capacity), merges=merges,
                tokens_after=backbone.num_tokens - sum(merges.values()),
                accuracy=float(np.mean(np.argmax(logits, axis=-1) == labels)),
                gmacs=merged_gmacs(model, merges),
            ))
    if any(capacity is not None for capacity in capacities):
        model.set_capacity(restore)
    return rows
