"""One trained MoNE model under every capacity allocation of Table 2 (MoNE Sec. 6).

Table 2 compares ways of splitting an effective capacity ``e_c`` over the
nested experts: Eq. 3 ("mone", the default), "greedy" (full expert and
smallest only), "mod_greedy" (full expert only, other tokens skip the
blocks) and the static "uniform" / "proportionate", which fix their own
``e_c`` (``keras_mone.routing.capacity``). ``compare_capacity_methods``
evaluates a trained model under each, with the same weights, at each ``e_c``
where the method applies; ``model_variant`` builds the re-configured twin.
"""

import keras
import numpy as np

from keras_mone.analysis.flops import flops
from keras_mone.models.weight_transfer import relative_weight_paths
from keras_mone.routing import capacity as capacity_lib

DYNAMIC_METHODS = tuple(capacity_lib.CAPACITY_DISTRIBUTIONS)


def model_variant(model, **backbone_overrides):
    """A twin of ``model`` whose backbone is rebuilt with ``backbone_overrides``
    (e.g. ``capacity_method``, ``capacity``, ``router_type``), holding copies
    of every weight of ``model`` at the same path; weights the twin lacks
    (a learned router when ``router_type="random"``) are left behind.

    Returns ``(twin, left_behind)``: the built twin and the sorted paths of
    ``model``'s weights that had no place in it.
    """
    backbone = model.backbone
    twin_backbone = type(backbone).from_config({**backbone.get_config(), **backbone_overrides})
    config = {k: v for k, v in model.get_config().items() if k != "backbone"}
    twin = type(model)(twin_backbone, **config)
    twin.build()
    source, target = relative_weight_paths(model), relative_weight_paths(twin)
    for path, variable in source.items():
        if path in target:
            if tuple(target[path].shape) != tuple(variable.shape):
                raise ValueError(f"{path}: shape {tuple(variable.shape)} in the model, {tuple(target[path].shape)} in the twin.")
            target[path].assign(keras.ops.copy(variable.value))
    return twin, sorted(set(source) - set(target))


def accuracy(model, x, y, batch_size=256):
    """Top-1 accuracy of ``model`` on ``(x, y)`` (integer labels)."""
    logits = model.predict(x, batch_size=batch_size, verbose=0)
    return float(np.mean(np.argmax(keras.ops.convert_to_numpy(logits), axis=-1) == np.asarray(y)))


def table2_settings(num_experts=4, capacities=(0.3, 0.4), methods=capacity_lib.CAPACITY_METHODS):
    """``[(method, e_c)]`` of ``methods``: each dynamic one at ``capacities`` and at
    the own e_c of the static ones in ``methods`` (4/15 and 15/32 at E = 4), each
    static one at its own; sorted by e_c."""
    unknown = [m for m in methods if m not in capacity_lib.CAPACITY_METHODS]
    if unknown:
        raise ValueError(f"Unknown capacity methods {unknown}; choose from {list(capacity_lib.CAPACITY_METHODS)}.")
    static = {
        m: capacity_lib.static_effective_capacity(m, num_experts) for m in capacity_lib.STATIC_CAPACITY_DISTRIBUTIONS if m in methods
    }
    dynamic = [m for m in DYNAMIC_METHODS if m in methods]
    settings = [(m, e_c) for e_c in sorted(set(capacities) | set(static.values())) for m in dynamic]
    settings += list(static.items())
    return sorted(settings, key=lambda s: (s[1], s[0]))


def compare_capacity_methods(model, x, y, settings=None, batch_size=256):
    """Accuracy and cost of ``model`` under each ``(method, e_c)`` of ``settings``
    (default ``table2_settings``), same weights throughout.

    Returns a list of dicts: ``method``, ``capacity`` (the e_c asked for),
    ``realised_capacity`` (whole-token counts), ``expert_capacities``,
    ``token_counts`` (per expert, then dropped), ``gmacs`` and ``accuracy``.
    """
    backbone = model.backbone
    if not hasattr(backbone, "capacity_method"):
        raise ValueError(f"`model` must be a MoNE model (a backbone with `capacity_method`), got {type(backbone).__name__}.")
    settings = table2_settings(backbone.num_experts) if settings is None else settings
    records = []
    for method, e_c in settings:
        twin, _ = model_variant(model, capacity_method=method, capacity=e_c)
        counts, dropped = twin.backbone.expert_token_counts()
        records.append(dict(
            method=method, capacity=float(e_c), realised_capacity=twin.realised_capacity,
            expert_capacities=[float(c) for c in twin.backbone.expert_capacities],
            token_counts=[int(c) for c in counts] + [int(dropped)],
            gmacs=flops(twin).gmacs, accuracy=accuracy(twin, x, y, batch_size),
        ))
    return records


def plot_capacity_methods(records, title="Capacity allocations (MoNE Table 2)"):
    """Accuracy against GMACs, one marker per method; returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in records):
        mine = sorted((r for r in records if r["method"] == method), key=lambda r: r["gmacs"])
        axis.plot([r["gmacs"] for r in mine], [100 * r["accuracy"] for r in mine], "o-", label=method)
    axis.set_xlabel("GMACs / example")
    axis.set_ylabel("test accuracy (%)")
    axis.set_title(title)
    axis.legend()
    figure.tight_layout()
    return figure


def markdown_table(records):
    """Rows ``e_c x method`` of accuracies (realised e_c in the cell when it differs)."""
    methods = list(dict.fromkeys(r["method"] for r in records))
    lines = ["| e_c | " + " | ".join(methods) + " |", "| --- |" + " --- |" * len(methods)]
    for e_c in sorted({r["capacity"] for r in records}):
        cells = []
        for method in methods:
            hit = [r for r in records if r["method"] == method and r["capacity"] == e_c]
            cells.append(f"{100 * hit[0]['accuracy']:.2f}% ({hit[0]['gmacs']:.5f})" if hit else "")
        lines.append(f"| {e_c:.4g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
