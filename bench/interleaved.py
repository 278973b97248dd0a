"""Forward timing of several models in one interleaved run, and its table (shared by the speed benches).

Models are compiled ``predict_on_batch`` functions (jit on jax), timed
round-robin so machine noise hits all alike; the figures to quote are ratios
against a reference model of the same run.
"""

import time

import keras
import numpy as np

from keras_mone import flops

TABLE_HEADER = [
    "| model | GMACs / image | FLOP ratio | median s / batch | speed-up | efficiency |",
    "| --- | --- | --- | --- | --- | --- |",
]


def time_models(named, inputs, repeats):
    """``{name: [seconds per call]}``: each model compiled once, then ``repeats`` interleaved rounds."""
    for model in named.values():
        model.predict_on_batch(inputs)  # compile
    times = {name: [] for name in named}
    for _ in range(repeats):
        for name, model in named.items():
            started = time.perf_counter()
            keras.ops.convert_to_numpy(model.predict_on_batch(inputs))
            times[name].append(time.perf_counter() - started)
    return times


def speed_rows(named, times, reference):
    """Table rows: GMACs, FLOP ratio, median time, speed-up and efficiency (speed-up / FLOP ratio) against ``reference``."""
    base_time, base_macs = np.median(times[reference]), flops(named[reference]).total
    rows = []
    for name, model in named.items():
        macs, seconds = flops(model).total, np.median(times[name])
        ratio, speedup = base_macs / macs, base_time / seconds
        rows.append(f"| {name} | {macs / 1e9:.2f} | {ratio:.2f}x | {seconds:.3f} | {speedup:.2f}x | {speedup / ratio:.2f} |")
    return rows
