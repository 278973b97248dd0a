"""Helpers every ``keras-mone analyze`` command shares: model and data loading, PNG + JSON output."""

import json
import os


def common_arguments(parser):
    parser.add_argument(
        "model", help="a preset name (`keras-mone presets`), a preset folder or a .keras file",
    )
    parser.add_argument(
        "--data", default=None, metavar="PRESET",
        help="the shipped preset whose test split to analyse (default: MODEL when it is one)",
    )
    parser.add_argument("--output", required=True, help="directory for the PNG and the JSON")
    parser.add_argument(
        "--num-images", type=int, default=None, help="first N >= 1 test examples (default: analysis' own)",
    )
    parser.add_argument("--batch-size", type=int, default=128, help="examples per call (>= 1)")
    parser.add_argument("--capacity", type=float, default=None, help="set_capacity(e_c) before the analysis")


#: Integer options of the analyses that count something (``dest -> flag``): each must be >= 1.
COUNT_OPTIONS = {
    "num_images": "--num-images", "batch_size": "--batch-size", "shown": "--shown", "top": "--top",
    "images_per_pass": "--images-per-pass", "timing_batch": "--timing-batch", "repeats": "--repeats",
}
#: Float options that must be > 0 (``dest -> flag``); ``--step`` must also be <= 1.
POSITIVE_OPTIONS = {"gmacs": "--gmacs", "latency_ms": "--latency-ms", "step": "--step"}


def check_arguments(args):
    """Raises ``ValueError`` naming the first option of ``args`` out of its range, and
    ``--output`` when it cannot become a directory; called before any work."""
    for dest, flag in COUNT_OPTIONS.items():
        value = getattr(args, dest, None)
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be an integer >= 1, got {value}.")
    for dest, flag in POSITIVE_OPTIONS.items():
        value = getattr(args, dest, None)
        if value is not None and not (0 < value <= (1 if dest == "step" else float("inf"))):
            allowed = "in (0, 1]" if dest == "step" else "> 0"
            raise ValueError(f"{flag} must be a number {allowed}, got {value:g}.")
    check_output(args.output)


def check_output(path):
    """Raises ``ValueError`` naming ``--output`` unless ``path`` is a writable directory
    or can be made one (its nearest existing ancestor a writable directory)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--output {path!r} is an existing file; give a directory (made if missing).")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"--output {path!r} lies under {existing!r}, a file: no directory can be made there.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--output {path!r}: the directory {existing!r} is not writable.")


def load_model(args):
    """The model ``args.model`` names (preset, preset folder or ``.keras`` file) at ``args.capacity``."""
    if str(args.model).endswith(".keras"):
        import keras

        import keras_mone  # noqa: F401  (registers the serializable classes)

        model = keras.saving.load_model(args.model, compile=False)
    else:
        from keras_mone.presets import from_preset

        model = from_preset(args.model)
    if getattr(args, "capacity", None) is not None:
        model.set_capacity(args.capacity)
    return model


def load_data(args, default_count=None):
    """``(x, y)``: the first ``--num-images`` (else ``default_count``) examples of the test split of
    ``--data`` (default: the model's preset)."""
    from keras_mone.presets import evaluation_data

    x, y = evaluation_data(args.data or args.model)
    count = default_count if args.num_images is None else args.num_images
    return (x, y) if count is None else (x[:count], y[:count])


def write_outputs(args, name, figure, summary):
    """Writes ``figure`` to ``<output>/<name>.png`` and ``summary`` (JSON-able) to
    ``<output>/<name>.json``; prints both paths."""
    os.makedirs(args.output, exist_ok=True)
    png = os.path.join(args.output, f"{name}.png")
    path = os.path.join(args.output, f"{name}.json")
    figure.savefig(png, dpi=100)
    with open(path, "w") as f:
        json.dump(_plain(summary), f, indent=2)
    print(f"wrote {png} and {path}")
    return png, path




def _plain(value):
    """JSON-able copy: numpy scalars to Python numbers, NaN (an undefined correlation) to null."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and not hasattr(value, "__len__"):
        value = value.item()
    if isinstance(value, float) and value != value:
        return None
    return value
