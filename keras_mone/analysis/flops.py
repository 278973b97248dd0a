"""Analytic multiply-accumulate (MAC) counts of keras_mone models.

Convention (timm / fvcore / DeiT, and the "FLOPs" of the MoNE paper): one
multiply-add is 1, counts are *per example*, and only matrix products and
convolutions are counted. For a ViT with ``N`` tokens, width ``D``, MLP width
``M``, patch ``P``, ``C`` channels, ``G`` patches and ``K`` classes:

    patch_embedding   G * P*P*C * D                 (the patch convolution)
    qkv               N * D * 3D        per block
    attention         2 * N^2 * D       per block   (QK^T and the weighted sum AV)
    attention_output  N * D * D         per block
    mlp               2 * N * D * M     per block   (fc1 and fc2)
    router            N * D * E         per learned router
    head              D * K

LayerNorm, softmax, GELU, biases, residuals, pooling and position embeddings
are not counted. ViT-B/16 at 224x224 with a class token and 1000 classes is
17.58 GMACs, as published.

ViViT-FE (Model 3): the tubelet convolution costs ``T/t * G * t*P*P*C * D``;
the spatial blocks run on each of the ``T/t`` frame indices (``N`` tokens
each); the temporal transformer's blocks run on ``T/t [+1]`` tokens and are
reported as one ``temporal`` component. ViViT-FE-B/16 on 32x224x224 clips is
about 283 GMACs, on 32x256x256 about 374.

MoNE (paper Sec. 3.1, 4.3, App. A.1): a token routed to the nested expert of
width ``d`` pays ``d * 3D`` in the QKV projection, ``D * d`` in the output
projection and ``d * M + M * d`` in the MLP; attention itself runs over all
non-dropped tokens at the full width ``D``. Per-expert token counts ``k_j``
are the static ones of Expert Preferred Routing at the model's current
capacity (``backbone.expert_token_counts()``); blocks before the first router
run every token at full width, dropped tokens (``mod_greedy``) skip the
block, and every router scores all ``N`` tokens (random routers cost nothing).

Every backbone of the ViT family is counted from the per-block plan of its
routing part (``backbone.token_routing().block_plan``: ``(tokens, width)``
groups per block), the same plan its forward pass runs, so the count cannot
drift from the model; a new routing method needs no counter of its own.

Counts are computed from configuration only: nothing is built and no weights
are allocated, so ViT-L or -H can be counted instantly.

Model families outside the ViT skeleton register their own counter::

    @register_flop_counter(MyVideoBackbone)
    def _count(model):
        return FlopCount({"patch_embedding": ..., **vit_block_macs(...)}, label="...")

``flops(model)`` uses the counter of the most specific registered class in
``type(model).__mro__``.
"""

import dataclasses
import types

from keras_mone.models.image_classifier import ImageClassifier
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.models.vivit_backbone import ViViTBackbone

COMPONENTS = (
    "patch_embedding",
    "qkv",
    "attention",
    "attention_output",
    "mlp",
    "router",
    "temporal",
    "head",
)
"""Canonical component names, in display order (counters may add others)."""

_COUNTERS = {}


@dataclasses.dataclass(frozen=True)
class FlopCount:
    """MACs per example of one model, by component.

    Attributes:
        breakdown: read-only mapping component -> MACs (ints), in
            ``COMPONENTS`` order, then any extra components.
        label: short description of the model that was counted.
        total: sum of the breakdown (int MACs).
        gmacs: ``total / 1e9``.

    Two counts add up (``a + b``) component by component.
    """

    breakdown: "types.MappingProxyType"
    label: str = ""

    def __post_init__(self):
        items = {}
        for name, value in dict(self.breakdown).items():
            if int(value) != value or value < 0:
                raise ValueError(f"MACs of {name!r} must be a non-negative integer, got {value!r}.")
            items[str(name)] = int(value)
        ordered = {name: items.pop(name) for name in COMPONENTS if name in items}
        ordered.update(items)
        object.__setattr__(self, "breakdown", types.MappingProxyType(ordered))

    @property
    def total(self):
        return sum(self.breakdown.values())

    @property
    def gmacs(self):
        return self.total / 1e9

    def __add__(self, other):
        if not isinstance(other, FlopCount):
            return NotImplemented
        merged = dict(self.breakdown)
        for name, value in other.breakdown.items():
            merged[name] = merged.get(name, 0) + value
        label = " + ".join(x for x in (self.label, other.label) if x)
        return FlopCount(merged, label=label)

    def __eq__(self, other):
        if not isinstance(other, FlopCount):
            return NotImplemented
        return dict(self.breakdown) == dict(other.breakdown) and self.label == other.label

    def __hash__(self):
        return hash((tuple(self.breakdown.items()), self.label))

    def __repr__(self):
        return f"FlopCount(total={self.total}, gmacs={self.gmacs:.4g}, label={self.label!r})"

    def __str__(self):
        total = self.total
        width = max([len("component"), len("total")] + [len(n) for n in self.breakdown])
        lines = [f"MACs per example: {self.label}" if self.label else "MACs per example"]
        lines.append(f"{'component':<{width}}  {'MACs':>16}  {'GMACs':>9}  {'share':>6}")
        rows = list(self.breakdown.items()) + [("total", total)]
        for i, (name, value) in enumerate(rows):
            if i == len(rows) - 1:
                lines.append("-" * (width + 37))
            share = value / total if total else 0.0
            lines.append(f"{name:<{width}}  {value:>16,}  {value / 1e9:>9.4f}  {share:>6.1%}")
        return "\n".join(lines)


def register_flop_counter(model_class):
    """Decorator registering ``fn(model) -> FlopCount`` for ``model_class``.

    The counter also serves sub-classes, unless they register their own.
    """

    def decorator(fn):
        _COUNTERS[model_class] = fn
        return fn

    return decorator


def flops(model):
    """Multiply-accumulates per example of ``model`` at its current capacity.

    Args:
        model: a ``ViTBackbone``, ``MoNEViTBackbone``, ``ImageClassifier`` or
            any instance of a class with a registered counter.

    Returns:
        A ``FlopCount`` (``.total`` MACs, ``.gmacs``, ``.breakdown``).
    """
    for klass in type(model).__mro__:
        if klass in _COUNTERS:
            return _COUNTERS[klass](model)
    known = ", ".join(sorted(k.__name__ for k in _COUNTERS))
    raise TypeError(
        f"No FLOP counter for {type(model).__name__}; known: {known}. "
        "Add one with `keras_mone.analysis.register_flop_counter`."
    )


def flop_ratio(reference, model):
    """``flops(reference).total / flops(model).total``, e.g. dense over MoNE."""
    return flops(reference).total / flops(model).total


# -- building blocks for counters -------------------------------------------------
def patch_embedding_macs(image_size, patch_size, num_channels, hidden_dim):
    """MACs of a non-overlapping ``patch_size`` convolution to ``hidden_dim``."""
    height, width = image_size
    patches = (height // patch_size) * (width // patch_size)
    return patches * patch_size * patch_size * num_channels * hidden_dim


def vit_block_macs(groups, hidden_dim, mlp_dim):
    """MACs of one (nested) pre-LN transformer block.

    Args:
        groups: ``(tokens, width)`` pairs: ``tokens`` tokens processed by the
            nested expert of width ``width`` (``[(N, D)]`` for a dense block).
            All listed tokens attend to each other at the full width.
        hidden_dim: model dimension ``D``.
        mlp_dim: MLP hidden width (not nested).

    Returns:
        ``{"qkv", "attention", "attention_output", "mlp"}`` -> MACs.
    """
    active = sum(tokens for tokens, _ in groups)
    return {
        "qkv": sum(tokens * width * 3 * hidden_dim for tokens, width in groups),
        "attention": 2 * active * active * hidden_dim,
        "attention_output": sum(tokens * hidden_dim * width for tokens, width in groups),
        "mlp": sum(2 * tokens * width * mlp_dim for tokens, width in groups),
    }


def _accumulate(total, part):
    for name, value in part.items():
        total[name] = total.get(name, 0) + value
    return total


def _size(backbone):
    height, width = backbone.image_size
    return f"{height}x{width}/{backbone.patch_size}, D={backbone.hidden_dim}, depth={backbone.depth}"


def _encoder_macs(backbone):
    """MACs per sequence of the encoder blocks and routers, from the plan its
    forward pass runs (``backbone.token_routing().block_plan``)."""
    routing = backbone.token_routing()
    counts = {}
    for groups in routing.block_plan(backbone.num_tokens):
        _accumulate(counts, vit_block_macs(groups, backbone.hidden_dim, backbone.mlp_dim))
    if routing.has_router:
        counts["router"] = routing.router_macs(backbone.num_tokens)
    return counts, routing.describe(backbone.num_tokens)


# -- counters of the built-in models ------------------------------------------------
@register_flop_counter(ViTBackbone)
def _vit_backbone_flops(backbone):
    """Any image backbone of the ViT family: the patch convolution, then the
    blocks as its routing part plans them (dense, MatViT, MoNE, MoD, A-MoD)."""
    counts = {
        "patch_embedding": patch_embedding_macs(
            backbone.image_size, backbone.patch_size, backbone.num_channels, backbone.hidden_dim
        )
    }
    encoder, plan = _encoder_macs(backbone)
    counts.update(encoder)
    return FlopCount(counts, label=f"{type(backbone).__name__}({_size(backbone)}, {plan})")


@register_flop_counter(ViViTBackbone)
def _vivit_backbone_flops(backbone):
    frames = backbone.num_frame_indices
    embedding = backbone.patch_embedding
    per_tubelet = backbone.tubelet_size * backbone.patch_size**2 * backbone.num_channels
    grid = embedding.grid_size[0] * embedding.grid_size[1]
    per_frame, plan = _encoder_macs(backbone)
    counts = {"patch_embedding": frames * grid * per_tubelet * backbone.hidden_dim}
    counts.update({name: frames * value for name, value in per_frame.items()})
    temporal = backbone.temporal_encoder
    block = vit_block_macs([(temporal.num_tokens, temporal.hidden_dim)], temporal.hidden_dim, temporal.mlp_dim)
    counts["temporal"] = temporal.depth * sum(block.values())
    label = (
        f"{type(backbone).__name__}({backbone.num_frames}x{_size(backbone)}, tubelet "
        f"{backbone.tubelet_size}, {frames} frame indices, spatial {plan}, "
        f"temporal depth {temporal.depth})"
    )
    return FlopCount(counts, label=label)


@register_flop_counter(ImageClassifier)
def _image_classifier_flops(model):
    body = flops(model.backbone)
    head = model.backbone.hidden_dim * model.num_classes
    label = f"{type(model).__name__}({body.label}, {model.num_classes} classes)"
    return FlopCount({**body.breakdown, "head": head}, label=label)
