"""Training recipes as data (``recipes/*.toml``, installed as ``keras_mone.recipe_files``).

``load(name, **overrides)`` builds the model, optimizer, datasets and callbacks
of a recipe; ``keras-mone train NAME key=value ...`` runs one.
"""

from keras_mone.recipes.builders import make_loss, make_optimizer
from keras_mone.recipes.files import list_recipes, parse_overrides, resolve
from keras_mone.recipes.loader import TrainingSetup, load
from keras_mone.recipes.schema import KEYS, RecipeError

__all__ = [
    "KEYS", "RecipeError", "TrainingSetup", "list_recipes", "load", "make_loss", "make_optimizer",
    "parse_overrides", "resolve",
]
