"""A preset's model card (``keras-mone presets show NAME``): what it is, costs, was trained for, scores."""

from keras_mone.methods.registry import set_setting
from keras_mone.presets.publish import evaluation_settings
from keras_mone.presets.registry import from_preset, get_preset, shipped_presets, weights_tags


def _recipe(name):
    from keras_mone.recipes.files import resolve

    return resolve(name)[0]


def _training_recipes(spec):
    """Bundled recipes that train the preset's architecture and variant."""
    from keras_mone.recipes.files import list_recipes

    names = []
    for recipe_name in list_recipes():
        try:
            recipe = _recipe(recipe_name)
        except Exception:  # a recipe that does not resolve alone says nothing about this preset
            continue
        if recipe["architecture"] == spec["architecture"] and recipe["variant"] == spec["variant"]:
            names.append(recipe_name)
    return names


def _gmacs(model, setting, value):
    """GMACs at ``set_<setting>(value)`` (capacity, width, ACM's execution)."""
    from keras_mone.analysis.flops import flops

    set_setting(model, setting, value)
    return flops(model).gmacs


def _key(value):
    """A manifest accuracy key as the value it names (``"0.5"`` -> 0.5, ``"exact"`` stays)."""
    try:
        return float(value)
    except ValueError:
        return value


def _mode(preset):
    return _recipe(get_preset(preset)["weights"]["recipe"])["mode"]


def budget_statement(name, model):
    """Whether one trained model of preset ``name`` (built as ``model``) serves
    every compute budget, and why."""
    spec = get_preset(name)
    entry = spec.get("weights")
    if evaluation_settings(model, spec["architecture"])[0] == "width":
        return "one model serves every trained width (set_width): the widths D/8..D are trained jointly."
    mode = _mode(name) if entry else None
    if mode is not None and mode != "fixed" and not mode.startswith("adaptive"):
        return f"trained with recipe mode {mode!r} (recipe {entry['recipe']}); scored as above."
    if not model.backbone.routed:
        return "one budget: no routing (capacity 1.0 only)."
    if not entry:
        return "no shipped weights: how well each budget is served depends on its training (mode=adaptive: all)."
    if mode.startswith("adaptive"):
        capacities = _recipe(entry["recipe"])["adaptive_capacities"]
        return (
            f"one model serves every budget: trained with adaptive capacity (e_c {min(capacities):g}.."
            f"{max(capacities):g}); set_capacity picks any."
        )
    adaptive = [
        other for other in shipped_presets()
        if get_preset(other)["architecture"] == spec["architecture"] and _mode(other).startswith("adaptive")
    ]
    return (
        f"trained at e_c {_recipe(entry['recipe'])['capacity']:g} only: set_capacity runs other budgets, but accuracy "
        f"drops away from it (see above). For every budget: {', '.join(adaptive) or 'train with mode=adaptive'}."
    )


def model_card(name):
    """The model card of preset ``name`` as text: architecture, size, parameters,
    GMACs per capacity / width, training data, recipe and command, accuracy
    per capacity / width (shipped presets), budgets served, weights tags."""
    spec = get_preset(name)
    model = from_preset(name, load_weights=False)
    backbone = model.backbone
    setting, values = evaluation_settings(model, spec["architecture"])
    entry = spec.get("weights")
    accuracy = entry["eval"]["accuracy"] if entry else {}
    if accuracy and entry["eval"]["setting"] == setting:
        values = tuple(_key(v) for v in accuracy)
    lines = [
        f"{name}: {spec['description']}",
        f"  architecture   {spec['architecture']} {spec['variant']}: {type(model).__name__}({type(backbone).__name__})",
        f"  input          {tuple(backbone.input_shape_per_example)} in [-1, 1] (data.ImageConverter maps uint8); "
        f"{model.num_classes} classes",
        f"  parameters     {model.count_params():,}",
        f"  {setting:<14} GMACs{'   test accuracy' if str(values[0]) in accuracy else ''}",
    ]
    for value in values:
        score = f"   {100 * accuracy[str(value)]:.2f}%" if str(value) in accuracy else ""
        lines.append(f"  {format(value, 'g') if isinstance(value, float) else value:<14} "
                     f"{_gmacs(model, setting, value):.4g}{score}")
    if entry:
        scored = entry["eval"]
        lines += [
            f"  trained for    {scored.get('dataset', 'cluttered_digits')} (bundled), recipe {entry['recipe']}",
            f"  command        {entry['command']}",
            f"  scored on      presets.evaluation_data({name!r}): the test split {scored['test_split']}",
            "  weights        shipped with the package (sha256-checked)",
        ]
    else:
        recipes = _training_recipes(spec)
        lines.append(
            "  trained for    not trained by the project (no shipped weights); recipes for it: "
            + (", ".join(f"keras-mone train {r}" for r in recipes) or "none bundled")
        )
    lines.append(f"  budgets        {budget_statement(name, model)}")
    for tag, description in weights_tags(name).items():
        lines.append(f"  weights={tag:<20} {description}")
    return "\n".join(lines)
