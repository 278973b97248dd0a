"""Checks the inputs of ``fit`` / ``evaluate`` / ``predict`` and keeps the model usable if they raise.

Two faults of Keras' loops that a model zoo must not pass on to its users:

* Input checks inside ``call`` run while the step is traced; on TensorFlow
  the traced shapes can be unknown, so a wrong image size slips through to an
  opaque reshape error. Arrays handed to a loop (anything with a shape and a
  dtype) are therefore checked up front with the model's ``check_inputs``,
  which names the argument and what is allowed.
* Keras' JAX trainer detaches the variables' values while its loop runs (the
  compiled step is stateless; the values travel in a state tuple) and puts
  them back only when the loop ends. An exception inside the loop would leave
  every variable empty, and the next ``predict``, ``get_weights`` or ``save``
  would fail. The guard holds references to the values from before the call
  (JAX arrays are immutable, so this costs no memory) and on an exception
  puts back the newest values the loop reached, then the saved ones for
  anything still detached.

``predict`` on zero examples returns an empty array of the output's shape
(Keras' loop fails on it with an unbound local); ``fit`` and ``evaluate`` on
zero examples raise a ``ValueError`` naming ``x`` on every backend (Keras
raises a bare ``StopIteration`` on jax, a build error on torch, nothing on
tensorflow).
"""

import keras
import numpy as np

_LOOPS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")


class LoopGuardMixin:
    def check_inputs(self, inputs):
        """Raises a ``ValueError`` if ``inputs`` do not fit (models override this)."""

    def _run_guarded(self, name, loop, args, kwargs):
        inputs = kwargs.get("x", args[0] if args else None)
        if hasattr(inputs, "shape") and hasattr(inputs, "dtype"):
            self.check_inputs(inputs)
            if len(inputs.shape) and inputs.shape[0] == 0:
                if name.startswith("predict"):
                    return self._empty_outputs(inputs)
                raise ValueError(
                    f"{name}: argument 'x' holds 0 examples (shape {tuple(inputs.shape)}); "
                    f"{name} needs at least one example."
                )
        if keras.backend.backend() != "jax":
            return loop(*args, **kwargs)
        saved = [(variable, variable.value) for variable in self._guarded_variables()]
        try:
            return loop(*args, **kwargs)
        except BaseException:
            self._reattach_values(saved)
            raise

    def _empty_outputs(self, inputs):
        spec = self.compute_output_spec(keras.KerasTensor((None, *inputs.shape[1:]), inputs.dtype))
        return keras.tree.map_structure(
            lambda s: np.zeros((0, *s.shape[1:]), keras.backend.standardize_dtype(s.dtype)), spec
        )

    def _guarded_variables(self):
        variables = list(self.variables) + list(self.metrics_variables)
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None:
            variables += list(optimizer.variables)
        return variables

    def _reattach_values(self, saved):
        # `_jax_state` / `_value` are the JAX trainer's own bookkeeping; Keras
        # has no public hook for "the loop failed".
        if getattr(self, "_jax_state", None):
            self.jax_state_sync()
        self._jax_state = None
        for variable, value in saved:
            if variable._value is None:
                variable.assign(value)


def _guarded(name):
    def method(self, *args, **kwargs):
        return self._run_guarded(name, getattr(super(LoopGuardMixin, self), name), args, kwargs)

    method.__name__ = name
    method.__doc__ = f"``keras.Model.{name}`` with its inputs checked first; the model stays usable if it raises."
    return method


for _name in _LOOPS:
    setattr(LoopGuardMixin, _name, _guarded(_name))
