"""Where a CPU recipe's training step goes (issue 27 item 4): jax profiler trace of ``train_on_batch``.

Builds a recipe's model, times ``train_on_batch`` and ``predict_on_batch`` on
freshly rendered batches, traces six training steps with ``jax.profiler`` and
sums the device ops by kind (numbered suffixes dropped), per step::

    KERAS_BACKEND=jax python bench/step_profile.py cluttered_digits_vit
"""

import collections
import glob
import gzip
import json
import re
import sys
import tempfile
import time

import jax

from keras_mone import recipes
from keras_mone.recipes.data_sources import digits_stream

TRACED_STEPS = 6


def per_step_ms(function, batches):
    started = time.perf_counter()
    for batch in batches:
        function(batch)
    return 1000 * (time.perf_counter() - started) / len(batches)


def device_ops(trace_dir):
    """``{op kind: microseconds}`` summed over the trace's device ops."""
    path = glob.glob(trace_dir + "/**/*.trace.json.gz", recursive=True)[0]
    kinds = collections.Counter()
    for event in json.load(gzip.open(path))["traceEvents"]:
        name = event.get("name", "")
        if event.get("ph") != "X" or name.startswith("$") or "Thunk" in name or "Pjit" in name:
            continue
        if name.startswith(("Device", "shard_args", "CommonPjRt", "Slinky")):
            continue
        kinds[re.sub(r"[._]?\d+$", "", name)] += event["dur"]
    return kinds


def main(argv=None):
    name = (argv or sys.argv[1:] or ["cluttered_digits_vit"])[0]
    setup = recipes.load(name, output_dir=tempfile.mkdtemp(), epochs=1)
    model = setup.model
    stream = digits_stream(recipes.resolve(name)[0])
    started = time.perf_counter()
    batches = [stream.batch(i) for i in range(12)]
    render_ms = 1000 * (time.perf_counter() - started) / len(batches)
    model.train_on_batch(*batches[0])
    model.predict_on_batch(batches[0][0])
    train_ms = per_step_ms(lambda b: model.train_on_batch(*b), batches[1:])
    predict_ms = per_step_ms(lambda b: model.predict_on_batch(b[0]), batches[1:])
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
        for batch in batches[:TRACED_STEPS]:
            model.train_on_batch(*batch)
    kinds = device_ops(trace_dir)
    total = sum(kinds.values())
    print(f"`KERAS_BACKEND=jax python bench/step_profile.py {name}` (jax {jax.__version__}, batch "
          f"{batches[0][0].shape[0]}): train_on_batch {train_ms:.0f} ms / step, predict_on_batch {predict_ms:.0f} ms, "
          f"rendering a batch {render_ms:.0f} ms; device ops while traced {total / TRACED_STEPS / 1000:.0f} ms / step:\n")
    print("| device op kind | ms / step | share |\n| --- | --- | --- |")
    for kind, micros in kinds.most_common(10):
        print(f"| {kind} | {micros / TRACED_STEPS / 1000:.1f} | {micros / total:.0%} |")


if __name__ == "__main__":
    main()
