"""Keeps compiled predict / evaluate / fit functions in step with the capacity.

Per-expert token counts are static, so a compiled function bakes in the
capacity it was traced with. Models that expose ``set_capacity`` mix this in:
whenever the routing key (the capacities of every routed backbone) differs
from the one the cached functions were built for, they are rebuilt.
"""


class CapacityControlMixin:
    def routing_key(self):
        """Hashable description of the current routing (overridden by models)."""
        return None

    def _refresh_compiled_functions(self):
        key = self.routing_key()
        if getattr(self, "_compiled_routing_key", None) != key:
            self.train_function = None
            self.test_function = None
            self.predict_function = None
            self._compiled_routing_key = key

    def make_train_function(self, force=False):
        self._refresh_compiled_functions()
        return super().make_train_function(force=force)

    def make_test_function(self, force=False):
        self._refresh_compiled_functions()
        return super().make_test_function(force=force)

    def make_predict_function(self, force=False):
        self._refresh_compiled_functions()
        return super().make_predict_function(force=force)
