"""A model trained with MoNE's learned router, evaluated under a random router (App. A.3, Sec. 6 / Fig. 7c).

The random router of Fig. 7c sends tokens to experts at random while every
expert keeps its capacity; App. A.3 reports that a model *trained* with the
learned router loses about 6 points of top-1 (ViT-Ti/16, ImageNet-1K) when
evaluated that way. ``learned_vs_random_router`` measures this on any
learned-router MoNE model, at the same capacities, with three rows per
capacity:

- ``learned``: the model as trained (Eq. 1 gate ``alpha r + 1``);
- ``learned_no_gate``: the same routing with the gate at 1 (``alpha = 0``),
  which separates the loss of the gate from the loss of the routing;
- ``random``: ``router_type="random"`` (random assignment, same per-expert
  token counts, no gate: the library's random-router model), one draw per
  seed of ``seeds``.
"""

import numpy as np

from keras_mone.analysis.capacity_methods import accuracy, model_variant
from keras_mone.analysis.flops import flops


def learned_vs_random_router(model, x, y, capacities=(0.2, 0.3, 0.5), seeds=(0, 1, 2), batch_size=256):
    """Accuracy of ``model`` with its learned router, without its gate, and
    with random routers (one per seed), at each of ``capacities``.

    Returns a list of dicts (one per capacity): ``capacity``, ``gmacs``,
    ``learned``, ``learned_no_gate``, ``random`` (per seed), ``random_mean``,
    ``random_std`` (sample std; 0 for one seed) and ``drop`` (learned minus
    random mean). ``model`` is left at its original capacity.
    """
    backbone = model.backbone
    if getattr(backbone, "router_type", None) != "learned":
        raise ValueError(
            f"`model` must be a MoNE model with a learned router, got {type(backbone).__name__}"
            f" (router_type={getattr(backbone, 'router_type', None)!r})."
        )
    original = backbone.capacity
    no_gate, _ = model_variant(model)
    for block in no_gate.backbone.blocks:
        if getattr(block, "alpha", None) is not None:
            block.alpha.assign(0.0)
    randoms = [model_variant(model, router_type="random", router_seed=int(seed))[0] for seed in seeds]
    records = []
    try:
        for capacity in capacities:
            for m in [model, no_gate] + randoms:
                m.set_capacity(capacity)
            random = [accuracy(m, x, y, batch_size) for m in randoms]
            learned = accuracy(model, x, y, batch_size)
            records.append(dict(
                capacity=float(capacity), gmacs=flops(model).gmacs, learned=learned,
                learned_no_gate=accuracy(no_gate, x, y, batch_size), random=random,
                random_mean=float(np.mean(random)),
                random_std=float(np.std(random, ddof=1)) if len(random) > 1 else 0.0,
                drop=learned - float(np.mean(random)),
            ))
    finally:
        model.set_capacity(original)
    return records


def plot_learned_vs_random(records, title="Learned vs random router (MoNE App. A.3)"):
    """Accuracy against e_c: learned, learned without gate, random (mean +- std)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    capacities = [r["capacity"] for r in records]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(capacities, [100 * r["learned"] for r in records], "o-", label="learned (as trained)")
    axis.plot(capacities, [100 * r["learned_no_gate"] for r in records], "s--", label="learned, gate at 1")
    axis.errorbar(
        capacities, [100 * r["random_mean"] for r in records], yerr=[100 * r["random_std"] for r in records],
        fmt="^-", capsize=3, label="random router",
    )
    axis.set_xlabel("effective capacity e_c")
    axis.set_ylabel("test accuracy (%)")
    axis.set_title(title)
    axis.legend()
    figure.tight_layout()
    return figure
