"""Keeps compiled predict / evaluate / fit functions in step with the capacity.

Per-expert token counts are static, so a compiled function bakes in the
capacity it was traced with. Models that expose ``set_capacity`` mix this in:
the compiled functions are kept per routing key (the capacities of the routed
backbone), so switching to a new capacity compiles once and switching back to
a capacity seen before reuses its functions (adaptive-capacity training draws
a capacity per step from a small set).
"""

import functools
import warnings

import keras

_FUNCTIONS = ("train_function", "test_function", "predict_function")
_STEPS = ("train_step", "test_step", "predict_step")


class CapacityControlMixin:
    def set_capacity_within(self, cost, budget, capacities):
        """Sets the largest of ``capacities`` whose ``cost(self)`` is at most ``budget``.

        One trained model serving a compute or latency budget (MoNE Sec. 5,
        adaptive capacity): ``cost`` is any measurement of the model at its
        current capacity, e.g. GMACs (``keras_mone.flops(model).gmacs``) or
        measured seconds per batch (``keras_mone.analysis.budget``, which
        builds both). Capacities are tried from the largest down and the
        search stops at the first that fits (cost falls with capacity);
        capacities the model refuses (``set_capacity`` raises) are skipped.

        Returns:
            dict: ``"capacity"``, its ``"cost"``, and ``"tried"``, the
            ``(capacity, cost)`` pairs measured. Raises a ``ValueError`` (with
            the cheapest cost seen) when none fits; the capacity is then
            restored.
        """
        previous = self.capacity
        tried = []
        for capacity in sorted({float(c) for c in capacities}, reverse=True):
            try:
                with warnings.catch_warnings():  # whole-token rounding warnings: `tried` reports the costs
                    warnings.simplefilter("ignore")
                    self.set_capacity(capacity)
            except ValueError:
                continue
            tried.append((capacity, float(cost(self))))
            if tried[-1][1] <= budget:
                return {"capacity": capacity, "cost": tried[-1][1], "tried": tried}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.set_capacity(previous)
        cheapest = min(tried, key=lambda pair: pair[1]) if tried else None
        raise ValueError(
            f"No capacity fits the budget {budget:g}: "
            + (f"the cheapest, {cheapest[0]:g}, costs {cheapest[1]:g}." if cheapest else "the model accepts none of them.")
        )

    def routing_key(self):
        """Hashable description of the current routing (overridden by models)."""
        return None

    def _refresh_compiled_functions(self):
        # Functions compiled for a previous optimizer / loss must not come
        # back from the cache: every compile() starts a new generation.
        key = (self.routing_key(), self.__dict__.get("_compile_generation", 0))
        # Stored in __dict__ directly: Keras' attribute tracking would turn the
        # tuples into lists, and the key would never compare equal again.
        current = self.__dict__.get("_compiled_routing_key")
        if current == key:
            return
        cache = self.__dict__.setdefault("_compiled_by_routing_key", {})
        cache[current] = tuple(getattr(self, name, None) for name in _FUNCTIONS)
        for name, function in zip(_FUNCTIONS, cache.get(key, (None,) * len(_FUNCTIONS))):
            setattr(self, name, function)
        # jax.jit caches traces by function, and bound methods of one object
        # compare equal: a rebuilt `jit(self.test_step)` would silently reuse
        # the trace of the previous capacity. A fresh partial per routing key
        # gives each capacity its own trace.
        for step in _STEPS:
            self.__dict__[step] = functools.partial(getattr(type(self), step), self)
        self.__dict__["_compiled_routing_key"] = key

    def compile(self, *args, **kwargs):
        self.__dict__["_compile_generation"] = self.__dict__.get("_compile_generation", 0) + 1
        return super().compile(*args, **kwargs)

    def compile_from_config(self, config):
        """Restores ``compile()`` when a ``.keras`` file is loaded, as Keras does
        for models that keep its ``compile``: Keras skips models that override
        it (ours only add bookkeeping) and then marks them compiled with no
        optimizer, so ``evaluate`` or ``fit`` on a loaded run's ``model.keras``
        failed. The optimizer is built here so its saved state loads into it.
        A compile config that does not deserialize (e.g. a custom loss not
        registered in this process) leaves the weights loaded and warns."""
        try:
            self.compile(**keras.saving.deserialize_keras_object(config))
        except Exception as error:  # noqa: BLE001 - any failure: the weights still load
            warnings.warn(
                f"The saved compile() settings could not be restored ({type(error).__name__}: {error}); the "
                "weights are loaded. Call `model.compile(...)` before `evaluate` or `fit`.", stacklevel=2,
            )
            return
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def make_train_function(self, force=False):
        self._refresh_compiled_functions()
        return super().make_train_function(force=force)

    def make_test_function(self, force=False):
        self._refresh_compiled_functions()
        return super().make_test_function(force=force)

    def make_predict_function(self, force=False):
        self._refresh_compiled_functions()
        return super().make_predict_function(force=force)
