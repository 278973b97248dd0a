"""The methods of the zoo and their registry (``registry.register_method``).

Each method family is a module here that registers its methods: ``dense``
(ViT, ViViT), ``mone`` (MoNE and its random router), ``matvit``, ``mod``
(MoD, A-MoD), ``mixer`` (MLP-Mixer, Sparse-MLP) and ``acm``; their names are
listed once, in ``families.FAMILIES``. An entry names its architectures
(backbone and task classes), training modes, recipe keys and checks, the
settings it is scored at and what a dense checkpoint leaves untrained in it;
presets, recipes, publishing and the model cards read the registry. This
package sits above ``models`` (the backbones and tasks it registers) and
``training`` (the modes and losses a method trains with), so neither of
those imports it.
"""

from keras_mone.methods.registry import (
    ARCHITECTURE_MODES,
    ARCHITECTURES,
    MODE_NAMES,
    TASKS,
    Architecture,
    Method,
    RecipeKey,
    Scoring,
    architecture_of,
    architectures,
    method_of,
    mode_of,
    register_method,
)
from keras_mone.methods.families import load_families

load_families()

__all__ = [
    "ARCHITECTURES", "ARCHITECTURE_MODES", "Architecture", "MODE_NAMES", "Method", "RecipeKey", "Scoring", "TASKS",
    "architecture_of", "architectures", "method_of", "mode_of", "register_method",
]
