"""Budget for latency: the capacity that fits a GMACs or a measured latency target on this device.

One trained MoNE (best one trained with adaptive capacity, MoNE Sec. 5) or
MoD model serves any budget by ``set_capacity``. ``capacity_for_budget``
picks the largest capacity whose cost fits: the analytic GMACs
(``keras_mone.flops``) or the median measured time of
``model.predict_on_batch`` on a batch of the caller's inputs on the current
backend and device. It rests on ``model.set_capacity_within(cost, budget,
capacities)``, which accepts any cost.
"""

import statistics
import time
import warnings

import numpy as np

from keras_mone.analysis.flops import flops


def default_capacities(model, step=0.05):
    """Capacities ``1.0, 1.0 - step, ..., step`` (those the model refuses are skipped by the search);
    a ``ValueError`` for models without a capacity (dense, MatViT, ACM)."""
    backbone = getattr(model, "backbone", model)
    if not getattr(backbone, "routed", False):
        raise ValueError(
            f"{type(backbone).__name__} has no capacity to set (`set_capacity` accepts 1.0 only): "
            "budget search applies to MoNE, MoD and A-MoD models (MatViT: `set_width`)."
        )
    return [round(1.0 - i * step, 6) for i in range(int(round(1.0 / step)))]


def gmacs_cost(model):
    """Analytic GMACs per example at the model's current capacity (``keras_mone.flops``)."""
    return flops(model).gmacs


def latency_cost(inputs, repeats=5, warmup=1, timer=time.perf_counter):
    """A cost function: median seconds of ``model.predict_on_batch(inputs)`` over ``repeats``
    timed calls after ``warmup`` untimed ones (which compile the capacity's function).

    ``timer`` is the clock (``time.perf_counter``; a stub in tests).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"`repeats` must be >= 1 and `warmup` >= 0, got {repeats} and {warmup}.")

    def cost(model):
        for _ in range(warmup):
            model.predict_on_batch(inputs)
        times = []
        for _ in range(repeats):
            start = timer()
            model.predict_on_batch(inputs)
            times.append(timer() - start)
        return statistics.median(times)

    return cost


def capacity_for_budget(model, gmacs=None, latency=None, inputs=None, capacities=None, repeats=5,
                        warmup=1, timer=time.perf_counter):
    """Sets and returns the largest capacity that fits a GMACs or a latency target.

    Args:
        model: a model with ``set_capacity`` and ``set_capacity_within``
            (MoNE, MoD, A-MoD classifiers).
        gmacs: target GMACs per example (analytic count), or
        latency: target seconds per call of ``model.predict_on_batch(inputs)``
            on this device (exactly one of the two).
        inputs: the batch to time (its batch size is part of the target).
        capacities: candidates (default ``default_capacities(model)``).
        repeats, warmup, timer: of the latency measurement (``latency_cost``).

    Returns:
        dict: ``"capacity"`` (now set on the model), ``"cost"``, ``"target"``,
        ``"unit"`` ("GMACs" or "seconds per batch"), ``"gmacs"`` at the chosen
        capacity, ``"tried"`` (``[capacity, cost]`` pairs measured, largest
        first). A ``ValueError`` when no capacity fits.
    """
    if (gmacs is None) == (latency is None):
        raise ValueError(f"Give exactly one of `gmacs` and `latency`, got gmacs={gmacs!r}, latency={latency!r}.")
    capacities = default_capacities(model) if capacities is None else list(capacities)
    if latency is not None:
        if inputs is None:
            raise ValueError("A latency target needs `inputs`, the batch to time on this device.")
        cost, target, unit = latency_cost(np.asarray(inputs), repeats, warmup, timer), float(latency), "seconds per batch"
    else:
        cost, target, unit = gmacs_cost, float(gmacs), "GMACs"
    choice = model.set_capacity_within(cost, target, capacities)
    return {
        "capacity": choice["capacity"],
        "realised_capacity": float(model.realised_capacity),
        "cost": choice["cost"],
        "target": target,
        "unit": unit,
        "gmacs": gmacs_cost(model),
        "tried": [list(pair) for pair in choice["tried"]],
    }


def cost_curve(model, cost, capacities):
    """``[(capacity, cost)]`` over ``capacities`` the model accepts (for plots); restores the capacity."""
    previous, curve = model.capacity, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for capacity in capacities:
            try:
                model.set_capacity(capacity)
            except ValueError:
                continue
            curve.append((float(capacity), float(cost(model))))
        model.set_capacity(previous)
    return curve


def plot_budget(curve, choice):
    """Cost against capacity with the target and the chosen capacity marked; returns the figure."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3.4))
    ax = fig.add_subplot()
    if curve:
        capacities, costs = zip(*curve)
        ax.plot(capacities, costs, "o-", ms=3, label=f"{choice['unit']} by capacity")
    ax.axhline(choice["target"], color="grey", ls="--", label="target")
    ax.plot([choice["capacity"]], [choice["cost"]], "r*", ms=12, label=f"chosen e_c={choice['capacity']:g}")
    ax.set_xlabel("capacity (e_c)")
    ax.set_ylabel(choice["unit"])
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
