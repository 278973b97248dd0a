"""The method registry: every conditional-computation method of the zoo, registered once.

A method (``Method``) declares, in its own module of ``keras_mone.methods``
(listed once in ``keras_mone.methods.families``), everything that differs
per method: its image and video architectures (the ``architecture`` of zoo
presets and recipes) with their backbone and task classes, the backbone
arguments it fixes, its training modes, its recipe keys with their checks
and how they become backbone arguments, the settings a model is scored at
(capacities, widths, executions), the parts a dense checkpoint leaves
untrained and the advice given about them. Presets, recipes, publishing,
model cards and the tests read this registry; no other module keeps a
table of method names. A method's cost plan is its backbone's routing part
(``backbone.token_routing()``, ``keras_mone.routing.parts``), which the
forward pass and ``keras_mone.flops`` both follow.

Adding a method is its backbone (a routing part and a block gate when the
existing ones do not serve), one module here with a ``register_method``
call, its name in ``families.FAMILIES``, and its zoo and recipe files;
docs/skeleton.md walks through one. The random router (MoNE Fig. 7c) is the
smallest case: an entry alone, reusing MoNE's backbone with
``router_type="random"`` fixed.
"""

import dataclasses
from collections.abc import Mapping
from typing import Callable

from keras_mone.models.variants import decode_variant
from keras_mone.training.modes import as_mode

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
class RecipeKey:
    """One recipe key: its default, type, one line of help and the values allowed.

    ``choices`` may be a Mapping (a live registry view): its keys are allowed.
    ``low`` / ``high`` are inclusive bounds of numbers, ``above`` an exclusive
    lower bound. ``model_source``: the value names a model (a ``.keras`` file
    or ``"preset:<name>"``) that must exist when set.
    """

    default: object
    kind: type | tuple
    doc: str
    choices: tuple | Mapping = ()
    low: float | None = None
    high: float | None = None
    above: float | None = None
    model_source: bool = False

    def __post_init__(self):
        if not isinstance(self.choices, Mapping):
            object.__setattr__(self, "choices", tuple(self.choices))


@dataclasses.dataclass(frozen=True)
class Scoring:
    """The setting a model is scored at (``set_<setting>(value)`` on the model
    or its backbone), the values its accuracy is recorded at, and its value now."""

    setting: str
    values: tuple
    current: object = None


def set_setting(model, setting, value):
    """``set_<setting>(value)`` on ``model`` if it has one, else on its backbone
    (``set_capacity``, MatViT's ``set_width``, ACM's ``set_execution``)."""
    owner = model if hasattr(model, f"set_{setting}") else model.backbone
    getattr(owner, f"set_{setting}")(value)


def scoring(model, architecture=None):
    """The ``Scoring`` of ``model`` (a task model) by its method: ``architecture``
    names it, else the backbone's class and fixed arguments do."""
    name = architecture or architecture_of(model.backbone)
    return method_of(name).scored_at(model.backbone)


#: e_c values a routed model's accuracy is recorded at (publish, model cards).
SCORED_CAPACITIES = (0.2, 0.3, 0.5, 0.75, 1.0)


def score_by_capacity(backbone):
    """A routed backbone at ``SCORED_CAPACITIES``, any other at capacity 1.0 only."""
    if getattr(backbone, "routed", False):
        return Scoring("capacity", SCORED_CAPACITIES, backbone.capacity)
    return Scoring("capacity", (1.0,), getattr(backbone, "capacity", 1.0))


def _no_check(recipe, fail):
    """A method whose keys need no check beyond their own type and bounds."""


def _nothing_untrained(backbone):
    return []


@dataclasses.dataclass(frozen=True)
class Method:
    """A method of the zoo: everything that differs per method.

    Attributes:
        name: the method's name ("dense", "mone", "matvit", ...).
        image: the image architecture.
        video: the video architecture (``None`` if the method has no video form).
        modes: the training modes it owns (``keras_mone.training.modes.TrainingMode``
            objects, or the names of standard ones); the first is the default.
        recipe_arguments: ``recipe -> {backbone argument: value}``, the recipe
            keys that configure the method (capacity, router type, width, ...).
        recipe_keys: ``{name: RecipeKey}``, the recipe keys the method owns. A
            key several methods share (``capacity``) is declared by each, alike.
            Any recipe may name them; one set away from its default in a recipe
            whose method does not own it is an error.
        check_recipe: ``(recipe, fail)`` checks across the method's keys and
            modes, run for recipes of its architectures; ``fail(message)`` raises.
        later_phase: ``recipe -> {key: value}``, what a phase after the first
            of a phased run (``phases``) sets beside ``init_from`` (ACM: the
            dense teacher).
        scored_at: ``backbone -> Scoring``, the settings its accuracy is
            recorded and shown at (publish, model cards, benchmarks).
        untrained: ``backbone -> [phrase]``, what a dense checkpoint loaded as
            its initialisation leaves untrained (empty: nothing).
        untrained_advice: ``(backbone, parts, command) -> str``, the warning's
            advice after naming the parts (``command``: the bundled recipe that
            trains it); ``None``: the capacity / width statement of
            ``keras_mone.presets.untrained``.
    """

    name: str
    image: Architecture
    video: Architecture = None
    modes: tuple = ("fixed",)
    recipe_arguments: Callable = lambda recipe: {}
    recipe_keys: Mapping = dataclasses.field(default_factory=dict)
    check_recipe: Callable = _no_check
    later_phase: Callable = lambda recipe: {}
    scored_at: Callable = score_by_capacity
    untrained: Callable = _nothing_untrained
    untrained_advice: Callable = None

    def __post_init__(self):
        object.__setattr__(self, "modes", tuple(as_mode(mode) for mode in self.modes))
        object.__setattr__(self, "recipe_keys", dict(self.recipe_keys))

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
    """Adds ``method``; its architecture names must be new, and a recipe key it
    shares with another method must be declared alike."""
    clash = set(architectures()) & {a.name for a in method.architectures}
    if method.name in METHODS or clash:
        raise ValueError(f"Method {method.name!r} or architecture(s) {sorted(clash)} registered twice.")
    for name, key in method.recipe_keys.items():
        owners = [m.name for m in METHODS.values() if m.recipe_keys.get(name, key) != key]
        if owners:
            raise ValueError(f"Method {method.name!r} declares recipe key {name!r} unlike method(s) {owners}.")
    METHODS[method.name] = method
    return method


def method_recipe_keys():
    """``{name: RecipeKey}`` over every registered method, in registration order."""
    keys = {}
    for method in METHODS.values():
        for name, key in method.recipe_keys.items():
            keys.setdefault(name, key)
    return keys


def key_owners(name):
    """The methods that own recipe key ``name``."""
    return [m for m in METHODS.values() if name in m.recipe_keys]


def _registered():
    """``(method, architecture)`` for every registered architecture, in registration order."""
    return [(m, a) for m in METHODS.values() for a in m.architectures]


def architectures():
    """``{architecture name: Architecture}`` over every registered method."""
    return {a.name: a for _, a in _registered()}


class LiveMapping(Mapping):
    """A read-only mapping recomputed from the registry on every read (``table()``):
    a method registered later shows up at once."""

    def __init__(self, table):
        self._table = table

    def __getitem__(self, name):
        return self._table()[name]

    def __iter__(self):
        return iter(self._table())

    def __len__(self):
        return len(self._table())

    # One table per call, not one per key (Mapping's defaults look every key up anew).
    def __contains__(self, name):
        return name in self._table()

    def keys(self):
        return self._table().keys()

    def items(self):
        return self._table().items()

    def values(self):
        return self._table().values()


class RegistryView(LiveMapping):
    """A read-only, always-current table over the registry:
    ``{architecture name: value(method, architecture)}`` for the architectures
    ``where(method, architecture)`` keeps. A method registered later (a
    plug-in, a test) shows up in every view at once."""

    def __init__(self, value, where=lambda method, architecture: True):
        super().__init__(lambda: {a.name: value(m, a) for m, a in _registered() if where(m, a)})

    def __getitem__(self, name):
        table = self._table()
        if name not in table:
            raise KeyError(f"Unknown architecture {name!r}; registered: {sorted(table)}.")
        return table[name]

    def __repr__(self):
        return f"RegistryView({self._table()!r})"


def method_of(architecture):
    """The ``Method`` an architecture name belongs to."""
    methods = {a.name: m for m, a in _registered()}
    if architecture not in methods:
        raise ValueError(f"Unknown architecture {architecture!r}; registered: {sorted(methods)}.")
    return methods[architecture]


ARCHITECTURES = RegistryView(lambda method, a: a.backbone)
"""Backbone class of each architecture name (a live view of the registry)."""
TASKS = RegistryView(lambda method, a: a.task)
"""Task (classifier) class of each architecture name (a live view of the registry)."""
ARCHITECTURE_MODES = RegistryView(lambda method, a: method.mode_names)
"""Training mode names of each architecture (a live view of the registry)."""


def mode_of(architecture, name):
    """The ``TrainingMode`` ``name`` of ``architecture``'s method."""
    return method_of(architecture).mode(name)


def _mode_names():
    """``{mode name: (architectures that own it)}`` (the recipe key ``mode``'s choices)."""
    table = {}
    for method, architecture in _registered():
        for name in method.mode_names:
            table.setdefault(name, []).append(architecture.name)
    return {name: tuple(names) for name, names in table.items()}


MODE_NAMES = LiveMapping(_mode_names)


def architecture_of(backbone):
    """The architecture name of ``backbone``: the entry with its exact class whose
    fixed arguments (``defaults``) it has, the one fixing most when several do."""
    fits = [
        (len(a.defaults), a.name) for _, a in _registered()
        if type(backbone) is a.backbone and all(getattr(backbone, k, None) == v for k, v in a.defaults.items())
    ]
    if not fits:
        raise ValueError(f"{type(backbone).__name__} is the backbone of no registered architecture.")
    return max(fits)[1]
