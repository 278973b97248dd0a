"""``keras-mone analyze NAME MODEL ...``: analyses of a trained model, each writing PNG + JSON.

``ANALYSES`` is the registry: ``name -> (add_arguments, run, help)``.
``add_arguments(parser)`` adds the analysis's own options to its
sub-command (the shared ones, ``MODEL``, ``--data``, ``--output``,
``--num-images``, ``--batch-size``, ``--capacity``, are already there,
``analyze_common.common_arguments``); ``run(args)`` does the work and
returns the exit status. ``analyze_common`` has the shared loading
(``load_model``, ``load_data``) and output (``write_outputs``) helpers.
Adding an analysis is a module with those two functions and one entry here
(issue 28's routing maps, argmax routing, token importance and budget are in
``analyze_commands.COMMANDS``; capacity-methods and random-router in
``analyze_ablations.COMMANDS``; token-merging in ``analyze_merging.COMMANDS``).
"""

import sys

from keras_mone.cli.analyze_ablations import COMMANDS as ABLATIONS
from keras_mone.cli.analyze_commands import COMMANDS
from keras_mone.cli.analyze_merging import COMMANDS as MERGING
from keras_mone.cli.analyze_common import check_arguments, common_arguments

ANALYSES = {**COMMANDS, **ABLATIONS, **MERGING}


def add_subcommand(commands):
    """Adds ``analyze`` with one sub-command per registered analysis to the ``keras-mone`` parser."""
    analyze = commands.add_parser(
        "analyze", help="analyses of a trained model (routing maps, argmax routing, ...): PNG + JSON",
    )
    names = analyze.add_subparsers(dest="analysis", required=True)
    for name, (add_arguments, run, help) in ANALYSES.items():
        parser = names.add_parser(name, help=help, description=help)
        common_arguments(parser)
        add_arguments(parser)
        parser.set_defaults(run=_runner(run))
    return analyze


def _runner(run):
    def run_analysis(args):
        try:
            check_arguments(args)  # before the model or the data load
            return run(args)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2

    return run_analysis
