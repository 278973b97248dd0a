"""The zoo's common plot: test accuracy against GMACs on cluttered digits, every method on one axis.

Draws the budget sweep (``bench/budget_sweep.py``: mean +- sd over seeds per
method and target), the multi-seed Mixer / Sparse-MLP / ACM results of
``bench/new_methods.py`` when their ``results.json`` exists, and the shipped
image presets at every recorded setting (one seed each, hollow markers)::

    python bench/budget_plot.py runs/budget_sweep/budget_sweep.json bench/figures/accuracy_vs_gmacs.png
"""

import json
import os
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402



def _mean_sd(values):
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def new_methods_points(path):
    """``{label: [(gmacs, mean %, sd %)]}`` from ``bench/new_methods.py``'s results.json."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        results = json.load(f)
    points = {}
    for key, rows in results.items():
        if key.startswith("acm_"):
            mean, sd = _mean_sd([100 * r["grouped"] for r in rows])
            points.setdefault("ACM grouped (new_methods)", []).append((rows[0]["gmacs"], mean, sd))
        elif key in ("mixer", "sparse_mlp"):
            mean, sd = _mean_sd([100 * r["accuracy"] for r in rows])
            points.setdefault({"mixer": "MLP-Mixer", "sparse_mlp": "Sparse-MLP"}[key], []).append(
                (rows[0]["gmacs"], mean, sd))
    return points


def shipped_points():
    """``{preset: [(gmacs, accuracy %)]}`` of the shipped image presets, from their manifest entries
    (GMACs recorded by ``keras-mone presets publish``, or counted from the preset when absent)."""
    from shipped_presets import rows  # loads every shipped preset

    points = {}
    for name, setting, value, accuracy, gmacs in rows():
        if "vivit" not in name:
            points.setdefault(name, []).append((gmacs, 100 * accuracy))
    return points


def plot_sweep(table, dense_gmacs, path, extra=None, shipped=True):
    """Writes the common plot to ``path``; ``table`` is ``budget_sweep.summarise``'s."""
    figure, axis = plt.subplots(figsize=(9, 6))
    methods = sorted({method for method, _ in table})
    for method in methods:
        entries = sorted((statistics.mean(e["gmacs"]), *_mean_sd([100 * a for a in e["accuracy"]]))
                         for (m, _), e in table.items() if m == method)
        xs, ys, sds = zip(*entries)
        axis.errorbar(xs, ys, yerr=sds, marker="o", capsize=3, label=f"{method} (sweep)")
    for label, entries in (new_methods_points(extra) if extra else {}).items():
        xs, ys, sds = zip(*sorted(entries))
        axis.errorbar(xs, ys, yerr=sds, marker="s", linestyle="--", capsize=3, label=label)
    if shipped:
        for name, entries in shipped_points().items():
            xs, ys = zip(*sorted(entries))
            axis.plot(xs, ys, marker="D", markerfacecolor="none", linestyle=":", label=f"{name} (shipped)")
    axis.axvline(dense_gmacs, color="grey", linewidth=0.8)
    axis.set_xlabel("GMACs per image")
    axis.set_ylabel("test accuracy % (5026 images)")
    axis.set_title("cluttered digits: accuracy against compute")
    axis.legend(fontsize=7, ncol=2)
    axis.grid(alpha=0.3)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return path


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    source, target = argv[0], argv[1]
    from budget_sweep import summarise

    with open(source) as f:
        saved = json.load(f)
    plot_sweep(summarise(saved["rows"]), saved["dense_gmacs"], target,
               extra=os.path.join(os.path.dirname(source), "..", "new_methods", "results.json"))
    print(target)


if __name__ == "__main__":
    main()
