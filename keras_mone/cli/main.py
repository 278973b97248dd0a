"""``keras-mone`` command line: quickstart, train, finetune, presets, bench, analyze."""

import argparse
import sys

from keras_mone.cli.analyze import add_subcommand as add_analyze
from keras_mone.cli.finetune import add_subcommand as add_finetune
from keras_mone.cli.finetune import fit_and_report
from keras_mone.host_memory import restart_subcommand_with_huge_pages


def _quickstart(args):
    from keras_mone.recipes import RecipeError, parse_overrides
    from keras_mone.cli.quickstart import run_quickstart

    try:
        overrides = parse_overrides(args.overrides)
        if args.epochs is not None:
            overrides["epochs"] = args.epochs
        run_quickstart(args.output, overrides)
    except RecipeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def _train(args):
    from keras_mone.recipes import RecipeError, list_recipes, load, parse_overrides

    if args.list or not args.recipe:
        for name, description in list_recipes().items():
            print(f"{name:<34} {description}")
        return 0
    try:
        setup = load(args.recipe, resume=not args.restart, **parse_overrides(args.overrides))
    except RecipeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return fit_and_report(setup)


def _presets(args):
    from keras_mone.presets import get_preset, list_presets, weights_tags

    if args.action == "publish":
        return _publish(args)
    if args.action == "verify":
        return _verify()
    if args.action == "show":
        return _show(args)
    for name in list_presets():
        spec = get_preset(name)
        marker = "[weights]" if spec.get("weights") else ""
        print(f"{name:<26} {marker:<9} {spec['description']}")
        default = spec.get("default_tag") or (get_preset(spec["tags_from"]).get("default_tag") if spec.get("tags_from") else None)
        for tag, description in weights_tags(name).items():
            print(f"{'':<26} {'weights=' + tag + (' (default)' if tag == default else ''):<36} {description}")
    return 0


def _publish(args):
    from keras_mone.presets.publish import publish_run

    if not args.run_dir or not args.name:
        print("error: `keras-mone presets publish RUN_DIR --name PRESET`", file=sys.stderr)
        return 2
    try:
        entry = publish_run(args.run_dir, args.name, command=args.command)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    accuracy = ", ".join(f"{k}: {100 * v:.2f}%" for k, v in entry["eval"]["accuracy"].items())
    print(f"Published {args.name}: {entry['file']} sha256 {entry['sha256']}; test accuracy by "
          f"{entry['eval']['setting']}: {accuracy}")
    return 0


def _show(args):
    from keras_mone.cli.preset_card import model_card

    if not args.run_dir:
        print("error: `keras-mone presets show NAME` (names: `keras-mone presets`)", file=sys.stderr)
        return 2
    try:
        print(model_card(args.run_dir))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def _verify():
    import os

    from keras_mone.presets import get_preset, shipped_presets
    from keras_mone.presets.weights import sha256_of

    status = 0
    for name in shipped_presets():
        entry = get_preset(name)["weights"]
        path = os.path.join(entry["folder"], entry["file"])
        ok = os.path.isfile(path) and sha256_of(path) == entry["sha256"]
        status |= not ok
        print(f"{name:<26} {'ok' if ok else 'CORRUPT OR MISSING':<18} {path}")
    return int(status)


def _bench(args):
    from keras_mone.bench.benchmark import (
        append_to_benchmarks,
        format_markdown,
        parse_model_override,
        run_benchmark,
    )

    result = run_benchmark(
        variant=args.variant,
        family=args.family,
        capacities=tuple(float(c) for c in args.capacities.split(",") if c.strip()),
        batch_size=args.batch_size,
        image_size=args.image_size,
        repeats=args.repeats,
        warmup=args.warmup,
        train_step=args.train_step,
        memory=args.memory,
        memory_calls=args.memory_calls,
        peer=args.peer,
        output_dir=args.output,
        seed=args.seed,
        model_overrides=dict(parse_model_override(o) for o in args.model_override),
        verbose=not args.quiet,
        precisions=[p for p in args.precision.split(",") if p.strip()],
        device_input=args.device_input,
        host_input=args.host_input,
        routing_probes=args.routing_probes,
        timm_peer=args.timm,
        torch_compile=args.torch_compile,
    )
    print(format_markdown(result))
    if args.append_benchmarks:
        append_to_benchmarks(result, args.append_benchmarks)
        print(f"appended to {args.append_benchmarks}")
    return 0


def _compile_modes(text):
    """``--torch-compile``'s modes, checked as the option is read."""
    from keras_mone.bench.torch_compile import PATHS, compile_modes

    try:
        return compile_modes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated modes of {list(PATHS)}, got {text!r}") from None


def _add_bench(commands):
    """The ``bench`` subcommand's options."""
    bench = commands.add_parser(
        "bench",
        help="time dense ViT vs MoNE-ViT (device and host input, precisions, train step, routing share, "
        "memory, timm peer) on this backend and device",
    )
    bench.add_argument("--variant", default="B/16", help="ViT size/patch, e.g. B/16 (default)")
    bench.add_argument(
        "--family", default="vit", choices=("vit", "vivit"),
        help="vit (images, default) or vivit (ViViT-FE on 32-frame clips)",
    )
    bench.add_argument("--capacities", default="0.2,0.3,0.5,0.75,1.0", help="comma-separated MoNE e_c")
    bench.add_argument("--batch-size", type=int, default=8)
    bench.add_argument("--image-size", type=int, default=224)
    bench.add_argument("--repeats", type=int, default=10, help="timed calls per model, interleaved")
    bench.add_argument("--warmup", type=int, default=2, help="untimed calls per model first (>= 1)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--output", default=None, help="directory for benchmark.json/.md and the plot")
    bench.add_argument("--no-train-step", dest="train_step", action="store_false", help="forward only")
    bench.add_argument("--memory", action="store_true", help="peak RSS per model and mode (subprocesses)")
    bench.add_argument("--memory-calls", type=int, default=3, help="calls per memory subprocess")
    bench.add_argument("--no-peer", dest="peer", action="store_false", help="skip the keras_hub reference")
    bench.add_argument(
        "--precision", default="float32", metavar="POLICIES",
        help="comma-separated Keras dtype policies, one set of models each: float32 (default), mixed_bfloat16, "
        "mixed_float16",
    )
    bench.add_argument(
        "--no-device-input", dest="device_input", action="store_false",
        help="skip the compiled steps on a batch already on the device",
    )
    bench.add_argument(
        "--no-host-input", dest="host_input", action="store_false",
        help="skip predict_on_batch / train_on_batch on numpy input",
    )
    bench.add_argument("--no-routing-probes", dest="routing_probes", action="store_false",
                       help="skip the router + EPR share probes")
    bench.add_argument("--no-timm", dest="timm", action="store_false", help="skip the timm (PyTorch) reference")
    bench.add_argument("--torch-compile", nargs="?", const=["default"], default=[], metavar="MODES",
                       type=_compile_modes,
                       help="torch backend: also time the forward under torch.compile, in its default mode or "
                            "in the comma-separated MODES of default, reduce-overhead (CUDA graphs)")
    bench.add_argument(
        "--model-override", action="append", default=[], metavar="KEY=VALUE",
        help="extra from_preset argument for all models (repeatable), e.g. depth=2",
    )
    bench.add_argument(
        "--append-benchmarks", default=None, metavar="BENCHMARKS.md",
        help="append the markdown report (command, backend, date, versions, machine) to this file",
    )
    bench.add_argument("--quiet", action="store_true", help="no progress lines")
    bench.set_defaults(run=_bench)


def build_parser():
    parser = argparse.ArgumentParser(prog="keras-mone", description="keras_mone command line")
    commands = parser.add_subparsers(dest="command", required=True)
    quickstart = commands.add_parser(
        "quickstart",
        help="train and evaluate a small MoNE-ViT and a dense ViT on bundled data (CPU, minutes)",
    )
    quickstart.add_argument("--output", required=True, help="directory for results and plots")
    quickstart.add_argument("--epochs", type=int, default=None, help="override the epoch count")
    quickstart.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE",
        help="recipe keys for both cluttered_digits_vit and cluttered_digits_mone, e.g. seed=1",
    )
    quickstart.set_defaults(run=_quickstart)
    train = commands.add_parser(
        "train", help="run a training recipe (recipes/*.toml) with key=value overrides; resumes"
    )
    train.add_argument("recipe", nargs="?", help="bundled recipe name or path to a .toml file")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. epochs=3 model_args.depth=2")
    train.add_argument("--list", action="store_true", help="list the bundled recipes")
    train.add_argument("--restart", action="store_true", help="start over: move the run directory's old run (checkpoints, history, model) to previous/<n>/")
    train.set_defaults(run=_train)
    add_finetune(commands)
    presets = commands.add_parser(
        "presets",
        help="list the model presets; show one's model card; publish a trained run as a preset's weights; verify them",
    )
    presets.add_argument("action", nargs="?", choices=("list", "show", "publish", "verify"), default="list")
    presets.add_argument(
        "run_dir", nargs="?", metavar="NAME_OR_RUN_DIR",
        help="show: the preset name; publish: the run directory of `keras-mone train`",
    )
    presets.add_argument("--name", help="publish: the preset whose weights the run becomes")
    presets.add_argument("--command", default="", help="publish: how the run was made (recorded)")
    presets.set_defaults(run=_presets)
    _add_bench(commands)
    add_analyze(commands)
    return parser


def main(argv=None):
    """The ``keras-mone`` command. Run as a command (``argv`` None), the
    subcommands that compute restart once with huge pages for the allocator's
    large blocks (``keras_mone.host_memory``: XLA's per-step buffers stop
    page-faulting 4 KB at a time); called from Python with ``argv`` the process
    stays as it is."""
    if argv is None:  # keras-mone restarted in keras_mone/__init__; this is `python -m keras_mone.cli.main`
        restart_subcommand_with_huge_pages(sys.argv[1:])
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
