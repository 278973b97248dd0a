"""Recipe files: bundled ``recipes/*.toml`` (or a path), ``base`` chains, ``key=value`` overrides.

``resolve(name, **overrides)`` returns the validated recipe with every key.
"""

import importlib.resources
import os
import tomllib

from keras_mone.overrides import parse_assignment
from keras_mone.recipes import schema

RECIPE_PACKAGE = "keras_mone.recipe_files"


def list_recipes():
    """``{name: description}`` of the bundled recipes (bases excluded), sorted."""
    from keras_mone.recipe_files import bundled_names

    return {name: _read(name)[0].get("description", "") for name in bundled_names()}


def _read(name_or_path, seen=()):
    """Raw keys of a recipe (bases merged in) and its name."""
    if name_or_path.endswith(".toml") or os.sep in name_or_path:
        if not os.path.exists(name_or_path):
            raise schema.RecipeError(f"Recipe file {name_or_path!r} does not exist.")
        with open(name_or_path, "rb") as f:
            raw = tomllib.load(f)
        name, folder = os.path.basename(name_or_path)[: -len(".toml")], os.path.dirname(name_or_path)
    else:
        entry = importlib.resources.files(RECIPE_PACKAGE).joinpath(f"{name_or_path}.toml")
        if not entry.is_file():
            raise schema.RecipeError(
                f"Unknown recipe {name_or_path!r}. Bundled recipes: {', '.join(list_recipes())}; "
                "or pass the path of a .toml file."
            )
        raw, name, folder = tomllib.loads(entry.read_text()), name_or_path, None
    base = raw.get("base")
    if base:
        if base in seen:
            raise schema.RecipeError(f"Recipe {name!r}: circular `base` chain {seen + (base,)}.")
        local = os.path.join(folder, f"{base}.toml") if folder else None
        parent, _ = _read(local if local and os.path.exists(local) else base, seen + (name,))
        raw = {**parent, **raw, "model_args": {**parent.get("model_args", {}), **raw.get("model_args", {})}}
    return raw, name


def parse_overrides(items):
    """``["epochs=3", "model_args.depth=2", "dataset=image_folder"]`` -> dict.

    Values are read by ``keras_mone.overrides.parse_value`` (TOML values; anything
    else is a string).
    """
    overrides = {}
    for item in items:
        try:
            key, value = parse_assignment(item, "Override")
        except ValueError as error:
            raise schema.RecipeError(str(error)) from None
        table, dot, sub = key.partition(".")
        if dot:
            overrides.setdefault(table, {})[sub] = value
        else:
            overrides[key] = value
    return overrides


def resolve(name_or_path, **overrides):
    """The validated recipe (all keys) and its name; raises ``RecipeError``."""
    raw, name = _read(name_or_path)
    for source in (raw, overrides):
        if not isinstance(source.get("model_args", {}), dict):
            raise schema.RecipeError(
                f"recipe {name!r}: key 'model_args' must be a table of backbone / classifier arguments "
                f"(e.g. {{ depth = 4 }}), got {source['model_args']!r}."
            )
    model_args = {**raw.get("model_args", {}), **overrides.pop("model_args", {})}
    raw = {**raw, **overrides, "model_args": model_args}
    raw.pop("base", None)
    recipe = schema.validate(raw, recipe_name=f"recipe {name!r}")
    if not recipe["output_dir"]:
        recipe["output_dir"] = os.path.join("runs", name)
    return recipe, name
