"""Training recipes (TOML), installed as the package ``keras_mone.recipe_files``."""

import importlib.resources as _resources


def bundled_names():
    """Sorted names of the bundled recipes (``*.toml`` here; ``_*`` files are bases, not recipes)."""
    return sorted(
        entry.name[: -len(".toml")] for entry in _resources.files(__name__).iterdir()
        if entry.name.endswith(".toml") and not entry.name.startswith("_")
    )
