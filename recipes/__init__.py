"""Training recipes (TOML), installed as the package ``keras_mone.recipe_files``."""
