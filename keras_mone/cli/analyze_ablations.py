"""MoNE's routing ablations as ``keras-mone analyze`` commands (issue 28 items 2 and 4).

``capacity-methods``: the model under every capacity allocation of Table 2
(``analysis.capacity_methods``); ``random-router``: a learned-router model
evaluated under random routers at the same capacities (App. A.3,
``analysis.router_ablation``). ``COMMANDS`` holds their ``(add_arguments,
run, help)`` entries for ``cli.analyze.ANALYSES``.
"""

from keras_mone.cli.analyze_common import load_data, load_model, write_outputs


def _floats(text):
    return [float(v) for v in text.split(",") if v.strip()]


def capacity_methods_arguments(parser):
    parser.add_argument(
        "--capacities", default="0.3,0.4",
        help="e_c of the dynamic allocations (mone, greedy, mod_greedy), besides the static ones' own",
    )
    parser.add_argument(
        "--methods", default="mone,greedy,mod_greedy,uniform,proportionate",
        help="capacity allocations to compare (Table 2's columns)",
    )


def run_capacity_methods(args):
    from keras_mone.analysis.capacity_methods import (
        compare_capacity_methods,
        markdown_table,
        plot_capacity_methods,
        table2_settings,
    )

    model = load_model(args)
    if not hasattr(model.backbone, "capacity_method"):
        raise ValueError(f"{args.model!r} is not a MoNE model: it has no capacity allocation to change.")
    x, y = load_data(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    settings = table2_settings(model.backbone.num_experts, _floats(args.capacities), methods)
    records = compare_capacity_methods(model, x, y, settings, args.batch_size)
    summary = dict(model=args.model, examples=len(y), records=records)
    write_outputs(args, "capacity_methods", plot_capacity_methods(records), summary)
    print(markdown_table(records))
    return 0


def random_router_arguments(parser):
    parser.add_argument("--capacities", default="0.2,0.3,0.5", help="e_c values to compare at")
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the random routers")


def run_random_router(args):
    from keras_mone.analysis.router_ablation import learned_vs_random_router, plot_learned_vs_random

    model = load_model(args)
    x, y = load_data(args)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    records = learned_vs_random_router(model, x, y, _floats(args.capacities), seeds, args.batch_size)
    summary = dict(model=args.model, examples=len(y), records=records)
    write_outputs(args, "random_router", plot_learned_vs_random(records), summary)
    for r in records:
        print(f"e_c {r['capacity']:g}: learned {100 * r['learned']:.2f}%, gate at 1 {100 * r['learned_no_gate']:.2f}%, "
              f"random {100 * r['random_mean']:.2f}% +- {100 * r['random_std']:.2f} (drop {100 * r['drop']:+.2f})")
    return 0


COMMANDS = {
    "capacity-methods": (
        capacity_methods_arguments, run_capacity_methods,
        "accuracy and GMACs under every capacity allocation of MoNE Table 2 (same weights)",
    ),
    "random-router": (
        random_router_arguments, run_random_router,
        "a learned-router MoNE model evaluated under random routers at the same capacities (App. A.3)",
    ),
}
