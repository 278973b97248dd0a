"""Routing plots: where every image token is sent (MoNE's nested expert, MoD / A-MoD
run or skipped, ACM's learner count), drawn as a per-token grid under each image."""

import textwrap

import numpy as np

from keras_mone.analysis.token_maps import method_kind, token_record
from keras_mone.models.record_call import forward_with_record
from keras_mone.routing.capacity import expert_width_fractions

#: Colour of a token that gets no compute (dropped, skipped, no learners), and those labels.
IDLE_COLOR = "#9e9e9e"
IDLE_LABELS = ("dropped", "skipped", "none (skipped)")


def routing_map(model, images, router=0):
    """Expert index of every patch token, ``(batch, grid_h, grid_w)`` ints:
    0 the smallest expert (D/2**(E-1)), ``E - 1`` the full one, -1 dropped."""
    backbone = getattr(model, "backbone", model)
    if not hasattr(backbone, "num_experts"):
        raise ValueError(
            f"`model` must be a MoNE image model (its backbone routes tokens to nested experts), "
            f"got {type(backbone).__name__}."
        )
    if len(images.shape) != 4:
        raise ValueError(f"`images` must be a batch of images (batch, H, W, C), got shape {tuple(images.shape)}.")
    _, intermediates = forward_with_record(backbone, images)
    routers = intermediates["expert_index"]
    if not 0 <= router < len(routers):
        raise ValueError(f"`router` must be in [0, {len(routers)}) (the model's routers), got {router!r}.")
    expert = routers[router]
    grid = tuple(backbone.patch_embedding.grid_size)
    expert = expert[:, expert.shape[1] - grid[0] * grid[1]:]  # drop a class token
    return expert.reshape(-1, *grid)


def width_label(fraction):
    """``"D"``, ``"D/2"``, ``"D/4"``, ... for an expert's share ``d_e / D`` of the full width."""
    return "D" if fraction >= 1 else f"D/{round(1 / fraction):d}"


def _check_router(router, count, what):
    if isinstance(router, bool) or not isinstance(router, (int, np.integer)) or not 0 <= router < count:
        raise ValueError(f"`router` must be an int in [0, {count}) (the model's {what}), got {router!r}.")


def routing_grid(model, images, router=0):
    """The per-token routing ``plot_routing`` draws, with a name for every value.

    Args:
        model: a routed image classifier or backbone: MoNE (and random-router
            MoNE), MoD, A-MoD or ACM, at the capacity to show.
        images: model-ready images ``(batch, H, W, C)`` in [-1, 1].
        router: which routing decision: MoNE's router (index into
            ``router_positions``), MoD / A-MoD's routed block (index into
            ``routed_blocks``), ACM's block.

    Returns:
        dict: ``"grid"`` ints ``(batch, grid_h, grid_w)`` (MoNE: expert index,
        0 the smallest, ``E - 1`` the full one, -1 dropped; MoD / A-MoD: 1 run,
        0 skipped; ACM: learners run), ``"labels"`` ``{value: name}`` for every
        value the method can give (MoNE's ``"dropped"`` only when a token is),
        ``"kind"`` (``token_maps.KINDS``), ``"title"`` (what and at which budget).
    """
    backbone = getattr(model, "backbone", model)
    images = np.asarray(images)
    if images.ndim != 4 or len(images) == 0:
        raise ValueError(f"`images` must be a non-empty batch of images (batch, H, W, C), got shape {images.shape}.")
    _, record = forward_with_record(backbone, images)
    try:
        kind = method_kind(record)
    except ValueError:
        raise ValueError(
            f"`model` must be a MoNE image model (its backbone routes tokens to nested experts) or another "
            f"routed image model (MoD, A-MoD, ACM), got {type(backbone).__name__}, which routes no tokens."
        ) from None
    if kind == "expert":
        _check_router(router, len(record["router_probs"]), "routers")
        where = f"router {router} (before block {backbone.router_positions[router]})"
        widths = expert_width_fractions(record["router_probs"][router].shape[-1])
        labels = {i: width_label(w) for i, w in enumerate(widths)}
        budget = f"e_c = {backbone.capacity:g}"
        what = "Nested expert of each token"
    elif kind == "kept":
        routed = [b for b, entry in enumerate(record["blocks"]) if "scores" in entry]
        _check_router(router, len(routed), "routed blocks")
        where = f"routed block {routed[router]}"
        labels = {0: "skipped", 1: "run"}
        budget = f"capacity {backbone.capacity:g}"
        what = "Tokens run or skipped"
    else:
        _check_router(router, len(record["blocks"]), "blocks")
        where = f"block {router}"
        learners = record["acm_probs"][router].shape[-1] - 1
        labels = {k: f"{k}/{learners} learners" for k in range(learners + 1)}
        labels[0] = "none (skipped)"
        budget = f"beta = {backbone.beta:g}"
        what = "ACM learners run for each token"
    grid = np.rint(token_record(model, images, decision=int(router))["assignment"]).astype("int32")
    if kind == "expert" and (grid < 0).any():
        labels = {-1: "dropped", **labels}
    keep = lambda text: text.replace(" ", "\u00a0")  # noqa: E731  (not broken when the title wraps)
    return {"grid": grid, "labels": labels, "kind": kind, "title": f"{what}, {keep(where)}, at {keep(budget)}"}


def _colors(labels):
    """One colour per label value: grey for no compute, then viridis from little to full compute."""
    from matplotlib import colormaps

    working = [v for v in sorted(labels) if labels[v] not in IDLE_LABELS]
    shades = colormaps["viridis"](np.linspace(0.2, 1.0, len(working)) if len(working) > 1 else [1.0])
    colors = {v: shade for v, shade in zip(working, shades)}
    return {v: colors.get(v, IDLE_COLOR) for v in sorted(labels)}


def plot_routing(model, images, path=None, num_images=8, router=0, *, input_alpha=0.35, grid_lines=True):
    """Draws where the tokens of the first ``num_images`` images go and saves a PNG.

    Top row: the input. Bottom row: one cell per patch token, coloured by the
    expert it is routed to (a legend names each by its width, D the full one;
    grey: dropped), at the model's current capacity (``model.set_capacity``),
    with the input faintly beneath. A learned router sends the object's
    tokens to the wide experts (MoNE paper, Fig. 1). MoD / A-MoD models show
    run or skipped tokens, ACM models the learners each token runs.

    Args:
        model: a MoNE image classifier or backbone (or MoD, A-MoD, ACM).
        images: model-ready images ``(batch, H, W, C)`` in [-1, 1]
            (``presets.evaluation_data`` or ``data.ImageConverter``).
        path: where to write the PNG (``None``: write nothing).
        num_images: how many of ``images`` to draw, from the first (int >= 1).
        router: which router's assignment to draw (index into
            ``router_positions``; MoD / A-MoD: routed block, ACM: block).
        input_alpha: how much of the input shows through the grid, in [0, 1)
            (0: the grid alone).
        grid_lines: draw thin lines between patches.

    Returns:
        The ``matplotlib.figure.Figure`` (shown inline in a notebook); its
        lower-row axes hold the grid as their last image (image ``i`` of
        ``n`` drawn: ``fig.axes[n + i].images[-1].get_array()``).

    Raises:
        ValueError: for a model that routes no tokens, a bad ``num_images``,
            ``router``, ``input_alpha`` or ``images``.
    """
    from matplotlib.figure import Figure  # before any check: without matplotlib, nothing runs

    _check_plot_arguments(num_images, input_alpha)
    images = np.asarray(images)[:num_images]
    routing = routing_grid(model, images, router)
    grid, labels = routing["grid"], routing["labels"]
    colors = _colors(labels)
    cmap, norm = _colormap(colors)

    count = len(images)
    width = max(4.5, 1.7 * count + 2.0)  # 2 in: the row labels and the legend
    title = textwrap.fill(routing["title"], width=int(width * 9))
    height = 3.8 + 0.22 * title.count("\n")
    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(2, count, squeeze=False)
    for i, image in enumerate(images):
        _draw_column(axes[:, i], image, grid[i], cmap, norm, input_alpha, grid_lines)
        if count > 1:
            axes[0, i].set_title(f"image {i}", fontsize=8)
    axes[0, 0].set_ylabel("input")
    row_label = {"expert": "expert per token", "kept": "run / skipped", "learners": "learners"}
    axes[1, 0].set_ylabel(row_label[routing["kind"]])
    _add_legend(axes[1, -1], colors, labels, routing["kind"])
    fig.suptitle(title, fontsize=10)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def _check_plot_arguments(num_images, input_alpha):
    """Refuses a ``num_images`` that is not an int >= 1 and an ``input_alpha`` outside [0, 1)."""
    if isinstance(num_images, bool) or not isinstance(num_images, (int, np.integer)) or num_images < 1:
        raise ValueError(f"`num_images` must be an int >= 1, got {num_images!r}.")
    if isinstance(input_alpha, bool) or not isinstance(input_alpha, (int, float)) or not 0 <= input_alpha < 1:
        raise ValueError(f"`input_alpha` must be a number in [0, 1), got {input_alpha!r}.")


def _colormap(colors):
    """``(colormap, norm)`` that paint each label value of ``colors`` (``{value: colour}``) its colour."""
    from matplotlib.colors import BoundaryNorm, ListedColormap

    values = sorted(colors)
    cmap = ListedColormap([colors[v] for v in values])
    norm = BoundaryNorm(np.append(np.array(values) - 0.5, values[-1] + 0.5), cmap.N)
    return cmap, norm


def _draw_column(column, image, grid, cmap, norm, input_alpha, grid_lines):
    """Draws one image in ``column[0]`` and its token grid over it, faintly, in ``column[1]``."""
    shown = np.clip((image.astype("float32") + 1) / 2, 0, 1)
    shown = shown[..., 0] if shown.shape[-1] == 1 else shown
    h, w = shown.shape[:2]
    column[0].imshow(shown, cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    below = column[1]
    if input_alpha > 0:
        below.imshow(shown, cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    below.imshow(grid, cmap=cmap, norm=norm, alpha=1 - input_alpha,
                 extent=(-0.5, w - 0.5, h - 0.5, -0.5), interpolation="nearest")  # over the pixels
    for ax in column:
        ax.set_xticks([])
        ax.set_yticks([])
    if grid_lines:
        rows, cols = grid.shape
        below.set_xticks(np.arange(1, cols) * w / cols - 0.5, minor=True)
        below.set_yticks(np.arange(1, rows) * h / rows - 0.5, minor=True)
        below.tick_params(which="minor", length=0)
        below.grid(which="minor", color="white", linewidth=0.4, alpha=0.6)


def _add_legend(ax, colors, labels, kind):
    """A legend right of ``ax`` naming each colour's label, the most compute first."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=colors[v], edgecolor="black", linewidth=0.4, label=labels[v])
               for v in reversed(sorted(colors))]
    legend_title = {"expert": "expert width\n(D: full)", "kept": "token", "learners": "ACM learners"}[kind]
    ax.legend(handles=handles, title=legend_title, loc="center left", bbox_to_anchor=(1.04, 0.5),
              fontsize=8, title_fontsize=8, frameon=False)
