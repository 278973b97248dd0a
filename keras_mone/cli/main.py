"""``keras-mone`` command line: quickstart, presets."""

import argparse
import sys


def _quickstart(args):
    from keras_mone.training.quickstart import QuickstartConfig, run_quickstart

    config = QuickstartConfig()
    if args.epochs is not None:
        config.epochs = args.epochs
    run_quickstart(args.output, config)
    return 0


def _presets(args):
    from keras_mone.presets import get_preset, list_presets

    for name in list_presets():
        print(f"{name:<16} {get_preset(name)['description']}")
    return 0


def build_parser():
    parser = argparse.ArgumentParser(prog="keras-mone", description="keras_mone command line")
    commands = parser.add_subparsers(dest="command", required=True)
    quickstart = commands.add_parser(
        "quickstart",
        help="train and evaluate a small MoNE-ViT and a dense ViT on bundled data (CPU, minutes)",
    )
    quickstart.add_argument("--output", required=True, help="directory for results and plots")
    quickstart.add_argument("--epochs", type=int, default=None, help="override the epoch count")
    quickstart.set_defaults(run=_quickstart)
    presets = commands.add_parser("presets", help="list the model presets")
    presets.set_defaults(run=_presets)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
