"""``keras-mone analyze token-merging``: ToMe on a trained model, accuracy against GMACs (issue 28 item 6).

Merge schedules are ``BLOCK:R`` pairs joined by ``+`` (``0:8+1:8`` merges 8
tokens before block 0 and 8 before block 1), several schedules separated by
commas; the empty schedule (no merging) is always included. MoNE models are
scored at every ``--capacities`` value (the MoNE paper's App. A.2: ToMe in
the blocks before the router compounds MoNE's savings).
"""

from keras_mone.cli.analyze_common import load_data, load_model, write_outputs


def parse_schedules(text):
    """``"0:8,0:8+1:8"`` -> ``[{}, {0: 8}, {0: 8, 1: 8}]``; raises ``ValueError`` naming ``--schedules``."""
    schedules = [{}]
    for schedule in filter(None, (part.strip() for part in text.split(","))):
        try:
            merges = {int(block): int(r) for block, r in (pair.split(":") for pair in schedule.split("+"))}
        except ValueError:
            raise ValueError(f"--schedules: {schedule!r} is not BLOCK:R pairs joined by '+' (e.g. 0:8+1:8).") from None
        schedules.append(merges)
    return schedules


def token_merging_arguments(parser):
    parser.add_argument("--schedules", default="0:8,0:16,0:24", help="merge schedules, e.g. 0:8,0:8+1:8")
    parser.add_argument("--capacities", default="", help="e_c values of a MoNE model (default: its current)")


def plot_rows(rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for capacity in sorted({r["capacity"] for r in rows}, key=lambda c: -1 if c is None else c):
        points = sorted((r["gmacs"], 100 * r["accuracy"]) for r in rows if r["capacity"] == capacity)
        base = [(r["gmacs"], 100 * r["accuracy"]) for r in rows if r["capacity"] == capacity and not r["merges"]]
        label = "model" if capacity is None else f"e_c {capacity:g}"
        axis.plot(*zip(*points), marker="o", label=f"{label} + ToMe")
        axis.plot(*zip(*base), marker="*", markersize=12, color="black", linestyle="none")
    axis.set_xlabel("GMACs per example")
    axis.set_ylabel("accuracy %")
    axis.set_title("token merging (stars: no merging)")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    return figure


def run_token_merging(args):
    from keras_mone.methods.mone.merging_sweep import token_merging_sweep

    schedules = parse_schedules(args.schedules)
    capacities = [float(c) for c in args.capacities.split(",") if c.strip()] or [None]
    model = load_model(args)
    x, y = load_data(args)
    rows = token_merging_sweep(model, x, y, schedules, capacities, args.batch_size)
    write_outputs(args, "token_merging", plot_rows(rows), dict(model=args.model, examples=len(y), rows=rows))
    for r in rows:
        at = "" if r["capacity"] is None else f"e_c {r['capacity']:g}, "
        print(f"{at}merges {r['merges'] or 'none'}: {r['tokens_after']} tokens, {100 * r['accuracy']:.2f}%, "
              f"{r['gmacs']:.5f} GMACs")
    return 0


COMMANDS = {
    "token-merging": (
        token_merging_arguments, run_token_merging,
        "token merging (ToMe) before the first router: accuracy against GMACs with and without it (App. A.2)",
    ),
}
