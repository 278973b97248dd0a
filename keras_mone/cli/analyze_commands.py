"""The analyses of issue 28 as ``keras-mone analyze`` commands: routing maps, argmax routing,
token importance and budget (``add_arguments`` / ``run`` pairs for ``cli.analyze.ANALYSES``)."""

from keras_mone.cli.analyze_common import load_data, load_model, write_outputs


def _decision_argument(parser):
    parser.add_argument(
        "--decision", type=int, default=None,
        help="routing decision to read: MoNE router index, MoD routed block in order, ACM block (default: first; ACM: mean)",
    )


def routing_maps_arguments(parser):
    _decision_argument(parser)
    parser.add_argument("--shown", type=int, default=6, help="images (frame indices for video) drawn")
    parser.add_argument("--fractions", default="1,0.75,0.5,0.25,0.1", help="token shares of the threshold sweep")


def run_routing_maps(args):
    from keras_mone.analysis.routing_maps import plot_routing_maps, routing_maps

    model = load_model(args)
    x, _ = load_data(args, default_count=256)
    fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    record, sweep, summary = routing_maps(model, x, args.decision, fractions, args.batch_size)
    summary.update(model=args.model, capacity=float(model.capacity))
    write_outputs(args, "routing_maps", plot_routing_maps(model, x, record, sweep, args.shown), summary)
    print(f"{summary['kind']} map; token shares {summary['token_share_by_assignment']}; sweep per-image share std "
          + ", ".join(f"{s['fraction']:g}: {s['std_share']:.3f}" for s in summary["sweep"]))
    return 0


def argmax_arguments(parser):
    _decision_argument(parser)
    parser.add_argument("--top", type=int, default=3, help="lowest / highest compute examples drawn (Fig. 11)")


def run_argmax(args):
    from keras_mone.analysis.argmax_routing import argmax_difficulty, plot_argmax_difficulty

    model = load_model(args)
    x, y = load_data(args)
    summary = argmax_difficulty(model, x, y, args.decision, args.batch_size, args.top)
    summary.update(model=args.model, capacity=float(model.capacity))
    write_outputs(args, "argmax_routing", plot_argmax_difficulty(x, summary, args.top), summary)
    print(f"Spearman(argmax compute, loss) = {_number(summary['spearman_compute_loss'])} over {summary['examples']} "
          f"examples; mean compute correct {summary['mean_compute_correct']}, wrong {summary['mean_compute_wrong']}")
    return 0


def importance_arguments(parser):
    _decision_argument(parser)
    parser.add_argument("--shown", type=int, default=4, help="images drawn")
    parser.add_argument("--images-per-pass", type=int, default=16, help="images whose N leave-one-out sequences run together")


def run_importance(args):
    from keras_mone.analysis.token_importance import importance_vs_score, plot_importance

    model = load_model(args)
    x, y = load_data(args, default_count=256)
    importance, score, summary = importance_vs_score(model, x, y, args.decision, args.images_per_pass, args.batch_size)
    summary.update(model=args.model, capacity=float(model.capacity))
    write_outputs(args, "token_importance", plot_importance(x, importance, score, summary, args.shown), summary)
    print(f"Spearman(leave-one-out, router score): per image {_number(summary['spearman_per_image_mean'])} +- "
          f"{_number(summary['spearman_per_image_std'])}, pooled {_number(summary['spearman_pooled'])}; of |loss "
          f"change|: per image {_number(summary['spearman_magnitude_per_image_mean'])}, pooled "
          f"{_number(summary['spearman_magnitude_pooled'])}; top-quarter overlap "
          f"{summary['top_quarter_overlap']:.3f} (chance {summary['top_quarter_overlap_by_chance']:.3f})")
    return 0


def budget_arguments(parser):
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--gmacs", type=float, help="target GMACs per example")
    target.add_argument("--latency-ms", type=float, help="target milliseconds per batch of --timing-batch examples")
    parser.add_argument("--timing-batch", type=int, default=64, help="examples per timed predict_on_batch call")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per capacity (median)")
    parser.add_argument("--step", type=float, default=0.05, help="capacity grid step (1.0 down to step)")


def run_budget(args):
    from keras_mone.analysis.budget import (
        capacity_for_budget, cost_curve, default_capacities, gmacs_cost, latency_cost, plot_budget,
    )

    model = load_model(args)
    capacities = default_capacities(model, args.step)
    x = None
    if args.latency_ms is not None:
        x, _ = load_data(args, default_count=args.timing_batch)
    latency = None if args.latency_ms is None else args.latency_ms / 1000
    choice = capacity_for_budget(model, gmacs=args.gmacs, latency=latency, inputs=x, capacities=capacities,
                                 repeats=args.repeats)
    cost = gmacs_cost if latency is None else latency_cost(x, args.repeats)
    curve = cost_curve(model, cost, capacities)
    choice.update(model=args.model, curve=[list(p) for p in curve], backend=_backend())
    write_outputs(args, "budget", plot_budget(curve, choice), choice)
    print(f"capacity {choice['capacity']:g} (realised {choice['realised_capacity']:.3f}): {choice['cost']:.5g} "
          f"{choice['unit']} <= target {choice['target']:.5g}; {choice['gmacs']:.5f} GMACs")
    return 0


def _number(value):
    return "n/a" if value is None or value != value else f"{value:.4f}"


def _backend():
    import keras

    return keras.backend.backend()


COMMANDS = {
    "routing-maps": (
        routing_maps_arguments, run_routing_maps,
        "where each token went (expert / kept / learners), the router's score, and the Fig. 1 threshold sweep",
    ),
    "argmax-routing": (
        argmax_arguments, run_argmax,
        "argmax routing without capacity limits: per-image compute ranks difficulty (App. A.3); Spearman vs loss",
    ),
    "token-importance": (
        importance_arguments, run_importance,
        "leave-one-out token importance (token removed) against the router's score: Spearman per image and pooled",
    ),
    "budget": (
        budget_arguments, run_budget,
        "set_capacity from a GMACs or a measured-latency target on this device: the largest capacity that fits",
    ),
}
