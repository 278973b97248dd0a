"""Settings the benchmark tests share (``test_bench.py``, ``test_bench_devices.py``): a tiny run of
`keras-mone bench` and the statistics each timed path reports."""

import importlib.util

from conftest import TINY

# `variant` picks the presets; the overrides shrink them to the tiny test geometry.
OVERRIDES = {k: v for k, v in TINY.items() if k != "image_size"} | {"num_classes": 10}
TINY_RUN = dict(
    variant="Ti/16",
    capacities=(0.5,),
    batch_size=2,
    image_size=TINY["image_size"],
    repeats=2,
    warmup=1,
    memory=False,
    model_overrides=OVERRIDES,
)
HAS_KERAS_HUB = importlib.util.find_spec("keras_hub") is not None
HAS_TIMM = importlib.util.find_spec("timm") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None
STAT_KEYS = {
    "median_s", "min_s", "max_s", "q25_s", "q75_s", "iqr_s", "latency_ms", "images_per_s",
    "times_s", "first_call_s", "speedup", "flop_ratio", "efficiency",
}
