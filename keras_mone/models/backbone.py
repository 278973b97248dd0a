"""The backbone contract: what every backbone of the zoo provides, and what task classes rely on.

``Backbone`` owns what every backbone shares, whatever its family (ViT,
ViViT, MLP-Mixer, ...):

- geometry: ``input_shape_per_example`` (one example's shape, batch
  excluded), ``num_tokens`` and ``hidden_dim`` (the output is ``(batch,
  num_tokens, hidden_dim)``), ``use_class_token`` (whether token 0 is a class
  token a task may read out; ``False`` unless the family has one);
- input checks: ``check_inputs(inputs)`` raises a ``ValueError`` naming the
  argument; the default compares rank, spatial size and channels with
  ``input_shape_per_example``;
- the capacity API: ``routed``, ``capacity``, ``realised_capacity``,
  ``set_capacity`` and ``routing_key()``. A backbone with no compute budget
  (dense ViT, Mixer, Sparse-MLP, whose expert capacity is a layer setting,
  not a budget) reports capacity 1.0 and refuses any other value with an
  error saying so;
- the forward pass: ``call(inputs, training=None, return_intermediates=False)``
  returns the tokens, or ``(tokens, record)`` with ``record`` a dict of the
  forward pass's intermediates (what a method's loss terms read,
  ``keras_mone.models.loss_terms``);
- the serving signature (``export`` with no first call), loops that leave
  the model usable when they raise, shape-checked ``load_weights``, and
  compiled functions kept per capacity (the mixins below);
- FLOPs: ``keras_mone.flops`` counts a backbone through the counter
  registered for its class (``keras_mone.analysis.flops.register_flop_counter``);
- config: constructor arguments are its config (``ConfigMixin``); an
  argument the constructor does not take is an error, never dropped.
"""

import keras

from keras_mone.layers.config import ConfigMixin
from keras_mone.models.capacity_control import CapacityControlMixin
from keras_mone.models.loop_guard import LoopGuardMixin
from keras_mone.models.serving import ServingMixin
from keras_mone.models.weights_file import SafeLoadingMixin
from keras_mone.routing import capacity as capacity_lib

#: Set by ``keras_mone.presets`` when it is imported (presets build models,
#: so models do not import presets): ``build(name, **kwargs)`` is its
#: ``from_preset`` and ``classes(name)`` gives ``(task class, backbone class)``
#: of a built-in name (``None`` for folders and hub handles).
PRESET_HOOKS = {}


def model_from_preset(cls, name, kwargs, part):
    """``from_preset`` of class ``cls``: the preset's model (``part="task"``) or
    its backbone (``part="backbone"``); an error naming both classes if the
    preset's class is not ``cls`` or a subclass of it."""
    if not PRESET_HOOKS:
        raise RuntimeError("`from_preset` needs keras_mone.presets: `import keras_mone` first.")
    classes = PRESET_HOOKS["classes"](name)
    index = 0 if part == "task" else 1
    if classes is not None:
        _check_preset_class(cls, name, classes[index])
    model = PRESET_HOOKS["build"](name, **kwargs)
    result = model if part == "task" else model.backbone
    _check_preset_class(cls, name, type(result))
    return result


def _check_preset_class(cls, name, preset_cls):
    if not issubclass(preset_cls, cls):
        raise ValueError(
            f"Preset {name!r} builds class {preset_cls.__name__}, not {cls.__name__}: call "
            f"{preset_cls.__name__}.from_preset({name!r}) or keras_mone.presets.from_preset({name!r})."
        )


class Backbone(LoopGuardMixin, SafeLoadingMixin, CapacityControlMixin, ConfigMixin, ServingMixin, keras.Model):
    """Base class of every backbone (see the module docstring for the contract)."""

    routed = False
    """Whether the backbone has a compute budget that ``set_capacity`` changes."""
    capacity = 1.0
    use_class_token = False

    @property
    def input_shape_per_example(self):
        raise NotImplementedError(f"{type(self).__name__} must define `input_shape_per_example`.")

    @property
    def num_tokens(self):
        raise NotImplementedError(f"{type(self).__name__} must define `num_tokens`.")

    @property
    def realised_capacity(self):
        """The capacity whole-token counts give (equal to ``capacity`` without routing)."""
        return self.capacity

    def set_capacity(self, capacity):
        """A backbone without routing runs at capacity 1.0 only; anything else is refused."""
        capacity = capacity_lib.validate_effective_capacity(capacity, None, "capacity")
        if capacity != 1.0:
            raise ValueError(
                f"{type(self).__name__} has no routing, so its `capacity` is fixed at 1.0 "
                f"(got {capacity}); use a routed backbone (e.g. MoNE) to change it."
            )

    def check_inputs(self, inputs):
        """Raises a ``ValueError`` naming the argument if ``inputs`` do not fit the model."""
        expected = tuple(self.input_shape_per_example)
        shape = tuple(inputs.shape)
        if len(shape) != len(expected) + 1:
            raise ValueError(
                f"`inputs` must have shape (batch, {', '.join(map(str, expected))}), got rank {len(shape)}: {shape}."
            )
        if shape[-1] != expected[-1]:
            raise ValueError(f"`inputs` must have {expected[-1]} channels, got {shape[-1]} (shape {shape}).")
        if tuple(shape[1:-1]) != expected[:-1]:
            raise ValueError(
                f"`inputs` must have spatial size {expected[:-1]}, got {tuple(shape[1:-1])}; "
                "resize the inputs or build the model with another `image_size`."
            )

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.num_tokens, self.hidden_dim)

    @classmethod
    def from_preset(cls, name, /, **kwargs):
        """The backbone of preset ``name`` (arguments as ``keras_mone.presets.from_preset``).

        Raises a ``ValueError`` naming both classes if the preset's backbone is
        not of this class, e.g. ``ViTBackbone.from_preset("mixer_digits")``.
        """
        return model_from_preset(cls, name, kwargs, "backbone")
