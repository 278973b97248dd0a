"""The method registry: every conditional-computation method of the zoo, registered once.

A method names its image and video architectures (the ``architecture`` of
zoo presets and recipes), their backbone and task classes, the backbone
arguments the method fixes, the training modes it supports and how recipe
keys become backbone arguments. Presets, recipes, the training modes and the
checks on them read this registry; no other module keeps a table of method
names. A method's cost plan is its backbone's routing part
(``backbone.token_routing()``, ``keras_mone.routing.parts``), which the
forward pass and ``keras_mone.flops`` both follow.

Adding a method is a routing part and a block gate (when the existing ones
do not serve), one ``register_method`` call, and its zoo and recipe files.
The random router (MoNE Fig. 7c) shows the smallest case: a registry entry
alone, reusing MoNE's backbone with ``router_type="random"`` fixed.
"""

import dataclasses
from collections.abc import Mapping
from typing import Callable

from keras_mone.models.image_classifier import ImageClassifier
from keras_mone.models.matvit_backbone import MatViTBackbone
from keras_mone.models.matvit_classifier import MatViTClassifier, MatViViTClassifier
from keras_mone.models.mod_vit_backbone import AMoDViTBackbone, MoDViTBackbone
from keras_mone.models.mone_vit_backbone import MoNEViTBackbone
from keras_mone.models.video_classifier import VideoClassifier
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.models.vivit_backbone import video_form


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One architecture name: its backbone class, task class and modality."""

    name: str
    backbone: type
    task: type
    video: bool
    defaults: dict = dataclasses.field(default_factory=dict)
    """Backbone arguments the architecture fixes (they win over presets and recipes)."""

    def build_backbone(self, **config):
        """The backbone of this architecture from ``config`` plus its ``defaults``."""
        return self.backbone(**{**config, **self.defaults})


@dataclasses.dataclass(frozen=True)
class Method:
    """A method of the zoo.

    Attributes:
        name: the method's name ("dense", "mone", "matvit", ...).
        image: the image architecture.
        video: the video architecture (``None`` if the method has no video form).
        modes: training modes it supports (``keras_mone.training.modes``).
        recipe_arguments: ``recipe -> {backbone argument: value}``, the recipe
            keys that configure the method (capacity, router type, width, ...).
    """

    name: str
    image: Architecture
    video: Architecture = None
    modes: tuple = ("fixed",)
    recipe_arguments: Callable = lambda recipe: {}

    @property
    def architectures(self):
        return tuple(a for a in (self.image, self.video) if a is not None)


METHODS = {}


def register_method(method):
    """Adds ``method``; its architecture names must be new."""
    clash = set(architectures()) & {a.name for a in method.architectures}
    if method.name in METHODS or clash:
        raise ValueError(f"Method {method.name!r} or architecture(s) {sorted(clash)} registered twice.")
    METHODS[method.name] = method
    return method


def _registered():
    """``(method, architecture)`` for every registered architecture, in registration order."""
    return [(m, a) for m in METHODS.values() for a in m.architectures]


def architectures():
    """``{architecture name: Architecture}`` over every registered method."""
    return {a.name: a for _, a in _registered()}


class RegistryView(Mapping):
    """A read-only, always-current table over the registry:
    ``{architecture name: value(method, architecture)}`` for the architectures
    ``where(method, architecture)`` keeps. A method registered later (a
    plug-in, a test) shows up in every view at once."""

    def __init__(self, value, where=lambda method, architecture: True):
        self._value, self._where = value, where

    def _table(self):
        return {a.name: self._value(m, a) for m, a in _registered() if self._where(m, a)}

    def __getitem__(self, name):
        table = self._table()
        if name not in table:
            raise KeyError(f"Unknown architecture {name!r}; registered: {sorted(table)}.")
        return table[name]

    def __iter__(self):
        return iter(self._table())

    def __len__(self):
        return len(self._table())

    def __repr__(self):
        return f"RegistryView({self._table()!r})"


def method_of(architecture):
    """The ``Method`` an architecture name belongs to."""
    methods = {a.name: m for m, a in _registered()}
    if architecture not in methods:
        raise ValueError(f"Unknown architecture {architecture!r}; registered: {sorted(methods)}.")
    return methods[architecture]


register_method(Method(
    "dense",
    image=Architecture("vit", ViTBackbone, ImageClassifier, video=False),
    video=Architecture("vivit", video_form(ViTBackbone), VideoClassifier, video=True),
))
register_method(Method(
    "mone",
    image=Architecture("mone_vit", MoNEViTBackbone, ImageClassifier, video=False),
    video=Architecture("mone_vivit", video_form(MoNEViTBackbone), VideoClassifier, video=True),
    modes=("fixed", "adaptive", "isoflops", "adaptive_isoflops"),
    recipe_arguments=lambda recipe: dict(
        capacity=recipe["capacity"], router_type=recipe["router_type"], router_seed=recipe["seed"]
    ),
))
register_method(Method(
    "matvit",
    image=Architecture("matvit", MatViTBackbone, MatViTClassifier, video=False),
    video=Architecture("matvivit", video_form(MatViTBackbone), MatViViTClassifier, video=True),
    modes=("fixed", "joint"),
    recipe_arguments=lambda recipe: dict(
        width_fraction=recipe["width_fraction"], joint_training=recipe["mode"] == "joint"
    ),
))

register_method(Method(
    "random_router",
    image=Architecture("random_mone_vit", MoNEViTBackbone, ImageClassifier, video=False,
                       defaults={"router_type": "random"}),
    video=Architecture("random_mone_vivit", video_form(MoNEViTBackbone), VideoClassifier, video=True,
                       defaults={"router_type": "random"}),
    recipe_arguments=lambda recipe: dict(capacity=recipe["capacity"], router_seed=recipe["seed"]),
))
register_method(Method(
    "mod",
    image=Architecture("mod_vit", MoDViTBackbone, ImageClassifier, video=False),
    video=Architecture("mod_vivit", video_form(MoDViTBackbone), VideoClassifier, video=True),
    recipe_arguments=lambda recipe: dict(capacity=recipe["capacity"]),
))
register_method(Method(
    "amod",
    image=Architecture("amod_vit", AMoDViTBackbone, ImageClassifier, video=False),
    video=Architecture("amod_vivit", video_form(AMoDViTBackbone), VideoClassifier, video=True),
    recipe_arguments=lambda recipe: dict(capacity=recipe["capacity"]),
))

ARCHITECTURES = RegistryView(lambda method, a: a.backbone)
"""Backbone class of each architecture name (a live view of the registry)."""
TASKS = RegistryView(lambda method, a: a.task)
"""Task (classifier) class of each architecture name (a live view of the registry)."""
