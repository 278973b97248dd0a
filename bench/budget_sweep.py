"""Every method of the zoo on cluttered digits across compute budgets (issue 28 item 8), one plot.

For each target ratio of the dense ViT's GMACs (``--targets``, default 0.25,
0.4, 0.6, 0.8) and each seed, trains with the same data and number of
images (the CPU recipes' renderings, ``--epochs`` each):

* isoFLOP dense: the ``cluttered_digits_vit`` recipe at the (depth, width)
  whose GMACs are nearest the target;
* MoNE fixed (``cluttered_digits_mone``), MoD and A-MoD (from scratch) at the
  capacity whose GMACs equal the target (bisection on ``keras_mone.flops``;
  a target below the method's lowest budget is reported as unreachable);
* one MoNE adaptive model and one MatViT model per seed, evaluated at every
  target (MatViT at its nested widths, the nearest GMACs it has);
* ACM converted from the shipped ``vit_digits`` (``cluttered_digits_acm_from_dense``,
  grouped execution) at the beta whose GMACs equal the target, where reachable.

``--from-dense`` is the task change that gives every method the same start:
each model is converted from the shipped ``vit_digits`` (the ``*_from_dense``
recipes: MoNE fixed and adaptive, MatViT, MoD, A-MoD, ACM; isoFLOP dense is
``vit_digits`` pruned to the (depth, width) of the target, its first blocks,
heads of 16 features and MLP units) and all train ``--epochs`` epochs.
Interrupted sweeps resume: runs whose rows are in the JSON are skipped;
``--report-only`` writes the table and plot from the rows there (the seeds
column says how many seeds each row has).

Writes into its ``--output`` run folder (default ``runs/budget_sweep[_from_dense]``)
``budget_sweep.json``, the report ``report.md`` and the accuracy-against-GMACs
plot ``accuracy_vs_gmacs[_from_dense].png`` (mean +- sd over seeds, with the
shipped presets and the Mixer / Sparse-MLP results of ``bench/new_methods.py``
where present). ``--update-benchmarks`` also writes the report as the
repository's BENCHMARKS.md section and the plot to ``bench/figures/`` (the
maintainers' commands)::

    KERAS_BACKEND=jax python bench/budget_sweep.py --seeds 0,1,2 --epochs 4 --update-benchmarks
    KERAS_BACKEND=jax python bench/budget_sweep.py --from-dense --seeds 0,1,2 --epochs 2 --update-benchmarks
"""

import argparse
import json
import os
import statistics
import tempfile
import warnings

import keras

from budget_plot import plot_sweep
from keras_mone import flops, recipes
from keras_mone.methods.matvit.method import SCORED_WIDTHS
from keras_mone.cli.quickstart import training_schedule
from new_methods import accuracy, test_split, train
from training_targets import write_section

SECTION = "## Every method across budgets on cluttered digits (issue 28 item 8)"
FROM_DENSE_SECTION = "## Every method converted from vit_digits, across budgets (issue 28 item 8)"
#: The recipe of each method: trained from scratch, or converted from ``vit_digits`` (``--from-dense``).
RECIPES = {
    False: dict(dense="cluttered_digits_vit", mone="cluttered_digits_mone", mod="cluttered_digits_mod", amod="cluttered_digits_amod",
                adaptive="cluttered_digits_mone_adaptive", matvit="cluttered_digits_matvit"),
    True: dict(dense="cluttered_digits_vit_from_dense", mone="cluttered_digits_mone_from_dense", mod="cluttered_digits_mod_from_dense",
               amod="cluttered_digits_amod_from_dense", adaptive="cluttered_digits_mone_adaptive_from_dense",
               matvit="cluttered_digits_matvit_from_dense"),
}
DENSE_SHAPES = [(d, w) for d in (1, 2, 3, 4) for w in (32, 48, 64)]
#: Heads of the isoFLOP dense models pruned from ``vit_digits`` keep its head width.
VIT_DIGITS_HEAD_WIDTH = 16
MATVIT_WIDTHS = SCORED_WIDTHS  # the widths publish and the model cards score
METHODS = ("isoFLOP dense", "MoNE", "MoD", "A-MoD", "MoNE adaptive", "MatViT", "ACM (grouped)")


def probe(recipe, **overrides):
    """The recipe's untrained model (built with one rendering per digit in a scratch folder)."""
    with tempfile.TemporaryDirectory() as scratch:
        return recipes.load(recipe, output_dir=scratch, samples_per_digit=1, test_samples_per_digit=1,
                            **overrides).model


def dense_gmacs():
    return flops(probe("cluttered_digits_vit")).gmacs


def solve_budget(gmacs_at, target_gmacs, low=0.01, high=1.0, steps=20, tolerance=0.03):
    """The budget in ``[low, high]`` whose GMACs equal ``target_gmacs`` within ``tolerance``
    (bisection; GMACs grow with the budget), or ``None`` when the method does not reach the target
    (``gmacs_at`` raises ``ValueError`` for a budget below the method's lowest)."""
    def at(value):
        try:
            return gmacs_at(value)
        except ValueError:
            return None

    for _ in range(steps):
        middle = (low + high) / 2
        value = at(middle)
        low, high = (middle, high) if value is None or value <= target_gmacs else (low, middle)
    candidates = [(abs(g - target_gmacs), v) for v in (low, high) if (g := at(v)) is not None]
    if not candidates or min(candidates)[0] > tolerance * target_gmacs:
        return None
    return round(min(candidates)[1], 4)


def capacity_gmacs(model):
    """``gmacs_at(capacity)`` of a routed model (the whole-token rounding warnings of the search muted)."""
    def gmacs_at(value):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            model.set_capacity(value)
        return flops(model).gmacs
    return gmacs_at


def set_capacity(model, value):
    model.set_capacity(value)


def beta_gmacs(classifier):
    """``gmacs_at(beta)`` of an ACM classifier in grouped execution (a backbone rebuilt per beta)."""
    config = classifier.backbone.get_config()

    def gmacs_at(value):
        backbone = type(classifier.backbone).from_config({**config, "beta": value, "execution": "grouped"})
        return flops(backbone).gmacs + flops(classifier).breakdown.get("head", 0) / 1e9
    return gmacs_at


def plan(targets, dense, from_dense=False):
    """``{(method, target): (recipe, overrides, evaluate-at)}`` of one seed; unreachable targets absent."""
    runs = {}
    recipes_of = RECIPES[from_dense]
    shapes = {shape: flops(probe("cluttered_digits_vit", model_args=dense_args(*shape, from_dense))).gmacs
              for shape in DENSE_SHAPES}
    routed = [(name, recipes_of[key], probe(recipes_of[key])) for name, key in
              (("MoNE", "mone"), ("MoD", "mod"), ("A-MoD", "amod"))]
    for target in targets:
        shape = min(shapes, key=lambda s: abs(shapes[s] / dense - target))
        runs[("isoFLOP dense", target)] = (recipes_of["dense"], {"model_args": dense_args(*shape, from_dense)}, None)
        for name, recipe, model in routed:
            capacity = solve_budget(capacity_gmacs(model), target * dense)
            if capacity is not None:
                runs[(name, target)] = (recipe, {"capacity": capacity}, capacity)
    return runs


def dense_args(depth, width, from_dense):
    """``model_args`` of the dense ViT of this (depth, width); pruned from ``vit_digits``, its head width."""
    args = dict(depth=depth, hidden_dim=width, mlp_dim=4 * width)
    return {**args, "num_heads": width // VIT_DIGITS_HEAD_WIDTH} if from_dense else args


def shape_name(model_args):
    """``"depth 3, D 48"``: the isoFLOP dense model's size (the setting column)."""
    return f"depth {model_args['depth']}, D {model_args['hidden_dim']}"


def data_overrides(args):
    return {} if args.samples_per_digit is None else {"samples_per_digit": args.samples_per_digit}


def steps_per_epoch(args):
    """``(steps per epoch, batch size)`` the sweep's models train with: the dense recipe's after
    ``--samples-per-digit`` (every recipe of the sweep shares its data and batch size)."""
    recipe, _ = recipes.resolve(RECIPES[args.from_dense]["dense"], **data_overrides(args))
    _, steps, batch = training_schedule(recipe)
    return steps, batch


def evaluate(model, images, labels, set_budget=None, value=None):
    if set_budget is not None:
        set_budget(model, value)
    return dict(accuracy=accuracy(model, images, labels), gmacs=flops(model).gmacs)


class Rows(list):
    """The sweep's rows, written to ``path`` after every append (an interrupted sweep keeps its rows);
    rows already in ``path`` are loaded, and ``done(method, seed)`` tells a resumed sweep what to skip."""

    def __init__(self, path, dense=None):
        super().__init__()
        self.path, self.dense = path, dense
        if os.path.exists(path):
            with open(path) as f:
                saved = json.load(f)
            super().extend(saved["rows"])
            self.dense = saved["dense_gmacs"] if dense is None else dense

    def done(self, method, seed, target=None):
        return any(r["method"] == method and r.get("seed") == seed and target in (None, r["target"]) for r in self)

    def append(self, row):
        super().append(row)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(dict(dense_gmacs=self.dense, rows=list(self)), f, indent=2)


def sweep_seed(seed, targets, dense, runs, args, data, out):
    """Appends ``{method, target, seed, accuracy, gmacs, setting}`` rows of one seed to ``out``."""
    images, labels = data
    recipes_of = RECIPES[args.from_dense]
    for (name, target), (recipe, overrides, capacity) in runs.items():
        if name not in args.methods or out.done(name, seed, target):
            continue
        folder = os.path.join(args.output, f"{name.replace(' ', '_')}_{target}_s{seed}")
        model = train(recipe, folder, seed=seed, epochs=args.epochs, **overrides, **data_overrides(args))
        row = evaluate(model, images, labels, set_capacity if capacity else None, capacity)
        setting = capacity or shape_name(overrides["model_args"])
        out.append(dict(method=name, target=target, seed=seed, setting=setting, **row))
    if "MoNE adaptive" in args.methods and not out.done("MoNE adaptive", seed):
        adaptive = train(recipes_of["adaptive"], os.path.join(args.output, f"MoNE_adaptive_s{seed}"),
                         seed=seed, epochs=args.epochs, **data_overrides(args))
        for target in targets:
            capacity = solve_budget(capacity_gmacs(adaptive), target * dense)
            if capacity is not None:
                out.append(dict(method="MoNE adaptive", target=target, seed=seed, setting=capacity,
                                **evaluate(adaptive, images, labels, set_capacity, capacity)))
    if "MatViT" in args.methods and not out.done("MatViT", seed):
        matvit = train(recipes_of["matvit"], os.path.join(args.output, f"MatViT_s{seed}"),
                       seed=seed, epochs=args.epochs, **data_overrides(args))
        for width in MATVIT_WIDTHS:
            row = evaluate(matvit, images, labels, lambda m, w: m.set_width(w), width)
            out.append(dict(method="MatViT", target=round(row["gmacs"] / dense, 2), seed=seed, setting=width, **row))
    acm_probe = probe("cluttered_digits_acm_from_dense")
    # ACM always starts from vit_digits; from scratch it keeps its recipe's one epoch, --from-dense trains --epochs
    acm_length = {"epochs": args.epochs} if args.from_dense else {}
    for target in targets:
        beta = solve_budget(beta_gmacs(acm_probe), target * dense)
        if "ACM (grouped)" not in args.methods or beta is None or out.done("ACM (grouped)", seed, target):
            continue
        model = train("cluttered_digits_acm_from_dense", os.path.join(args.output, f"ACM_{target}_s{seed}"),
                      seed=seed, beta_target=beta, **acm_length, **data_overrides(args))
        model.backbone.set_execution("grouped")
        out.append(dict(method="ACM (grouped)", target=target, seed=seed, setting=beta,
                        **evaluate(model, images, labels)))


def summarise(rows):
    """``{(method, target): {accuracy: [..], gmacs: mean, setting}}`` over seeds."""
    table = {}
    for row in rows:
        entry = table.setdefault((row["method"], row["target"]), dict(accuracy=[], gmacs=[], setting=row["setting"]))
        entry["accuracy"].append(row["accuracy"])
        entry["gmacs"].append(row["gmacs"])
    return table


def section_title(args):
    """The BENCHMARKS.md section of this sweep: one per regime, and one per method subset and length."""
    if tuple(args.methods) == METHODS:
        return FROM_DENSE_SECTION if args.from_dense else SECTION
    start = "converted from vit_digits" if args.from_dense else "from scratch"
    return (f"## {', '.join(args.methods)} across budgets on cluttered digits, {start}, "
            f"{args.epochs} epochs (issue 28 item 8)")


def command(args):
    """The command line that reproduces this report (the flags that change what it says)."""
    words = [f"KERAS_BACKEND={keras.backend.backend()}", "python", "bench/budget_sweep.py"]
    if tuple(args.methods) != METHODS:
        words.append(f"--methods \"{','.join(args.methods)}\"")
    if args.from_dense:
        words.append("--from-dense")
    words += ["--seeds", args.seeds, "--epochs", str(args.epochs), "--targets", args.targets]
    if args.samples_per_digit is not None:
        words += ["--samples-per-digit", str(args.samples_per_digit)]
    if args.update_benchmarks:
        words.append("--update-benchmarks")
    return " ".join(words)


def report(table, dense, args, seeds, plot_path, schedule):
    """The sweep's markdown section; ``schedule`` is ``(steps per epoch, batch size)`` of its training runs."""
    def spread(values):
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{100 * statistics.mean(values):.2f} +- {100 * sd:.2f}"

    steps, batch = schedule
    if args.from_dense:
        trained = (f"Every model is converted from the shipped `vit_digits` (97.59%) and trains {args.epochs} epoch(s) "
                   f"= {steps * args.epochs} steps of {batch} fresh renderings")
    else:
        trained = (f"Every model trained {args.epochs} epoch(s) = {steps * args.epochs} steps of {batch} "
                   f"fresh renderings of the CPU recipes (ACM: the conversion recipe's one epoch = {steps} steps "
                   "from `vit_digits`)")
    lines = [
        section_title(args), "",
        f"Command: `{command(args)}`. {trained}; 5026 test images; mean +- sample sd over the seeds of {seeds} "
        f"each row ran (column seeds); dense ViT at {dense:.5f} GMACs. Plot: `{plot_path}`.", "",
        "| method | target x dense | setting | GMACs | accuracy % | seeds |", "|---|---|---|---|---|---|",
    ]
    for (method, target), entry in sorted(table.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        gmacs = statistics.mean(entry["gmacs"])
        lines.append(f"| {method} | {target} | {entry['setting']} | {gmacs:.5f} | {spread(entry['accuracy'])} "
                     f"| {len(entry['accuracy'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--targets", default="0.25,0.4,0.6,0.8")
    parser.add_argument("--samples-per-digit", type=int, default=None,
                        help="training renderings per digit (default: each recipe's; small for a smoke run)")
    parser.add_argument("--from-dense", action="store_true",
                        help="every method converted from the shipped vit_digits (the *_from_dense recipes)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)} (e.g. the pairs a finding compares)")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: report the rows already in --output's budget_sweep.json")
    parser.add_argument("--output", default=None,
                        help="run folder (default runs/budget_sweep[_from_dense]): runs, budget_sweep.json, "
                             "report.md and the plot")
    parser.add_argument("--update-benchmarks", action="store_true",
                        help="also write the report as the --benchmarks section and the plot to bench/figures/ "
                             "(maintainers)")
    parser.add_argument("--plot", default=None,
                        help="default --output/accuracy_vs_gmacs[_from_dense].png, or in bench/figures/ "
                             "with --update-benchmarks")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md", help="the file --update-benchmarks writes")
    args = parser.parse_args(argv)
    suffix = "_from_dense" if args.from_dense else ""
    args.output = args.output or f"runs/budget_sweep{suffix}"
    figures = os.path.join("bench", "figures") if args.update_benchmarks else args.output
    args.plot = args.plot or os.path.join(figures, f"accuracy_vs_gmacs{suffix}.png")
    args.methods = [m.strip() for m in args.methods.split(",")]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    targets = [float(t) for t in args.targets.split(",")]
    rows = Rows(os.path.join(args.output, "budget_sweep.json"))
    if args.report_only and rows.dense is None:
        parser.error(f"--report-only: no {rows.path} to report")
    if not args.report_only:
        images, labels, _ = test_split()
        rows.dense = dense = dense_gmacs()
        runs = plan(targets, dense, from_dense=args.from_dense)
        for seed in seeds:
            sweep_seed(seed, targets, dense, runs, args, (images, labels), rows)
    table = summarise([r for r in rows if r.get("seed", seeds[0]) in seeds and r["method"] in args.methods])
    extra = None if args.from_dense else os.path.join("runs", "new_methods", "results.json")
    plot_sweep(table, rows.dense, args.plot, extra=extra)
    text = report(table, rows.dense, args, seeds, args.plot, steps_per_epoch(args))
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "report.md"), "w") as f:
        f.write(text)
    if args.update_benchmarks:
        write_section(text, args.benchmarks, section_title(args))
    print(text)


if __name__ == "__main__":
    main()
