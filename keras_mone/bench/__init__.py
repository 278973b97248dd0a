"""``keras-mone bench``: dense ViT against MoNE-ViT (and timm, keras_hub) on this backend and device.

An application above the library (it builds presets and times them):
``benchmark.run_benchmark`` runs it, ``measure`` times calls interleaved,
``device`` / ``precision`` time compiled steps on inputs already on the
device in each dtype policy, ``memory`` measures process and device memory,
``models`` builds the models compared, ``report`` / ``tables`` write the
markdown. docs/benchmarks.md says how to run it, also on a GPU.
"""
