"""``model.export`` without a first call: the input signature from the model's own geometry."""

import importlib.util

import keras

ONNX_MODULES = ("onnx", "onnxscript")
"""What Keras' dynamo ONNX exporter needs on the torch backend (the ``[onnx]`` extra)."""


class ServingMixin:
    """Gives ``export`` a default ``input_signature``.

    Keras infers a subclassed model's input signature from its first call, so
    a model that was only built (``from_preset``, ``load_model``) could not be
    exported. Backbones and classifiers know their input shape
    (``input_shape_per_example``), so the signature defaults to a float32 batch
    of it: batch size free, except for ONNX on the torch backend, where Keras'
    dynamo exporter needs a static batch (1 by default; pass
    ``input_signature`` for another). The exported graph serves the capacity /
    width the model runs at when exported.
    """

    def default_input_signature(self, format="tf_saved_model"):
        batch = 1 if format == "onnx" and keras.backend.backend() == "torch" else None
        shape = self.backbone.input_shape_per_example if hasattr(self, "backbone") else self.input_shape_per_example
        return [keras.InputSpec(shape=(batch, *shape), dtype="float32")]

    def export(self, filepath, format="tf_saved_model", verbose=None, input_signature=None, **kwargs):
        if format == "onnx" and keras.backend.backend() == "torch":
            missing = [m for m in ONNX_MODULES if importlib.util.find_spec(m) is None]
            if missing:  # Keras would fall back to TorchScript tracing, which breaks routed models
                raise ImportError(
                    f"ONNX export on the torch backend needs {', '.join(ONNX_MODULES)} (missing: "
                    f"{', '.join(missing)}); install them with `pip install \"keras-mone[onnx]\"`."
                )
        if not self.built:
            self.build()
        if input_signature is None:
            input_signature = self.default_input_signature(format)
        return super().export(filepath, format=format, verbose=verbose, input_signature=input_signature, **kwargs)
