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

from keras_mone.methods.acm import register as _register_acm
from keras_mone.models.image_classifier import ImageClassifier
from keras_mone.models.matvit_backbone import MatViTBackbone
from keras_mone.models.mixer_backbone import (
    MixerBackbone,
    SparseMLPBackbone,
    decode_mixer_variant,
    decode_sparse_mlp_variant,
)
from keras_mone.models.matvit_classifier import MatViTClassifier, MatViViTClassifier
from keras_mone.models.mod_vit_backbone import AMoDViTBackbone, MoDViTBackbone
from keras_mone.models.mone_vit_backbone import MoNEViTBackbone
from keras_mone.models.sparse_mlp_classifier import SparseMLPClassifier
from keras_mone.models.variants import decode_variant
from keras_mone.models.video_classifier import VideoClassifier
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.models.vivit_backbone import video_form
from keras_mone.training.modes import FIXED, JOINT, TrainingMode, as_mode

#: The tiny sizes the shared test harness builds (image and video ViTs).
VIT_TINY = dict(image_size=32, patch_size=8, hidden_dim=32, depth=2, num_heads=4, mlp_dim=64, use_class_token=True)
VIVIT_TINY = dict(
    image_size=16, patch_size=8, hidden_dim=32, depth=2, num_heads=4, mlp_dim=64,
    num_frames=4, tubelet_size=2, temporal_depth=1,
)


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One architecture name: its backbone class, task class, modality and sizes.

    Attributes:
        name: the ``architecture`` of presets and recipes.
        backbone, task: the backbone class (a ``keras_mone.models.backbone.Backbone``)
            and the task class that wraps it.
        video: whether it takes videos.
        defaults: backbone arguments the architecture fixes (they win over
            presets and recipes).
        decode_variant: ``variant string -> backbone arguments`` (its size
            table: ``"B/16"`` for ViTs).
        tiny: the tiny configuration the shared test harness builds it at.
    """

    name: str
    backbone: type
    task: type
    video: bool
    defaults: dict = dataclasses.field(default_factory=dict)
    decode_variant: Callable = decode_variant
    tiny: dict = None

    @property
    def tiny_config(self):
        """The harness's tiny configuration (the ViT / ViViT one unless the entry sets its own)."""
        if self.tiny is not None:
            return dict(self.tiny)
        return dict(VIVIT_TINY if self.video else VIT_TINY)

    def build_backbone(self, **config):
        """The backbone of this architecture from ``config`` plus its ``defaults``;
        an argument the backbone does not take is an error naming it."""
        from keras_mone.layers.config import config_argument_names

        allowed = set(config_argument_names(self.backbone)) | {"dtype", "name"}
        unknown = sorted(set(config) - allowed)
        if unknown:
            raise ValueError(
                f"{self.backbone.__name__} (architecture {self.name!r}) takes no argument(s) {unknown}; "
                f"its arguments: {sorted(allowed - {'dtype', 'name'})}."
            )
        return self.backbone(**{**config, **self.defaults})


@dataclasses.dataclass(frozen=True)
class Method:
    """A method of the zoo.

    Attributes:
        name: the method's name ("dense", "mone", "matvit", ...).
        image: the image architecture.
        video: the video architecture (``None`` if the method has no video form).
        modes: the training modes it owns (``keras_mone.training.modes.TrainingMode``
            objects, or the names of standard ones); the first is the default.
        recipe_arguments: ``recipe -> {backbone argument: value}``, the recipe
            keys that configure the method (capacity, router type, width, ...).
    """

    name: str
    image: Architecture
    video: Architecture = None
    modes: tuple = ("fixed",)
    recipe_arguments: Callable = lambda recipe: {}

    def __post_init__(self):
        object.__setattr__(self, "modes", tuple(as_mode(mode) for mode in self.modes))

    @property
    def architectures(self):
        return tuple(a for a in (self.image, self.video) if a is not None)

    @property
    def mode_names(self):
        return tuple(mode.name for mode in self.modes)

    def mode(self, name):
        """The ``TrainingMode`` called ``name``; an error listing this method's modes otherwise."""
        for mode in self.modes:
            if mode.name == name:
                return mode
        raise ValueError(f"Method {self.name!r} has no training mode {name!r}; its modes: {list(self.mode_names)}.")


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
    modes=(
        TrainingMode("fixed", FIXED.description + " (one width)", model_arguments=lambda recipe: {"joint_training": False}),
        JOINT,
    ),
    recipe_arguments=lambda recipe: dict(width_fraction=recipe["width_fraction"]),
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

#: The tiny sizes of the harness for the Mixer family (32x32 images, 16 tokens).
MIXER_TINY = dict(image_size=32, patch_size=8, hidden_dim=16, depth=1, token_mlp_dim=8, channel_mlp_dim=32)
SPARSE_MLP_TINY = dict(
    MIXER_TINY, sparse_depth=1, sparse_tokens=24, sparse_hidden_dim=8, token_num_experts=4,
    token_expert_dim=16, channel_num_experts=2, channel_expert_dim=16, seed=0,
)
register_method(Method(
    "mixer",
    image=Architecture("mixer", MixerBackbone, ImageClassifier, video=False,
                       decode_variant=decode_mixer_variant, tiny=MIXER_TINY),
))
register_method(Method(
    "sparse_mlp",
    image=Architecture("sparse_mlp", SparseMLPBackbone, SparseMLPClassifier, video=False,
                       decode_variant=decode_sparse_mlp_variant, tiny=SPARSE_MLP_TINY),
))

_register_acm(register_method, Method, Architecture)

ARCHITECTURES = RegistryView(lambda method, a: a.backbone)
"""Backbone class of each architecture name (a live view of the registry)."""
TASKS = RegistryView(lambda method, a: a.task)
"""Task (classifier) class of each architecture name (a live view of the registry)."""
ARCHITECTURE_MODES = RegistryView(lambda method, a: method.mode_names)
"""Training mode names of each architecture (a live view of the registry)."""


def mode_of(architecture, name):
    """The ``TrainingMode`` ``name`` of ``architecture``'s method."""
    return method_of(architecture).mode(name)


class ModeNames(Mapping):
    """``{mode name: (architectures that own it)}``, live over the registry (recipe key choices)."""

    def _table(self):
        table = {}
        for method, architecture in _registered():
            for name in method.mode_names:
                table.setdefault(name, []).append(architecture.name)
        return {name: tuple(names) for name, names in table.items()}

    def __getitem__(self, name):
        return self._table()[name]

    def __iter__(self):
        return iter(self._table())

    def __len__(self):
        return len(self._table())


MODE_NAMES = ModeNames()
