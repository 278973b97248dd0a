"""Routing maps: which nested expert each image token is sent to, drawn over the images."""

import numpy as np

from keras_mone.models.record_call import forward_with_record


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


def plot_routing(model, images, path=None, num_images=8, router=0):
    """Draws the first ``num_images`` images over their routing map and saves a PNG.

    Top row: the input. Bottom row: each patch dimmed by the width of the
    expert its token is routed to (full brightness: the full expert; darkest:
    dropped), at the model's current capacity (``model.set_capacity``). A
    learned router lights up the object (MoNE paper, Fig. 1).

    Args:
        model: a MoNE image classifier or backbone.
        images: model-ready images ``(batch, H, W, C)`` in [-1, 1]
            (``presets.evaluation_data`` or ``data.ImageConverter``).
        path: where to write the PNG (``None``: write nothing).
        num_images: how many of ``images`` to draw.
        router: which router's assignment to draw (index into ``router_positions``).

    Returns:
        The ``matplotlib.figure.Figure`` (shown inline in a notebook).
    """
    from matplotlib.figure import Figure

    if isinstance(num_images, bool) or not isinstance(num_images, int) or num_images < 1:
        raise ValueError(f"`num_images` must be an int >= 1, got {num_images!r}.")
    images = np.asarray(images)[:num_images]
    expert = routing_map(model, images, router)
    backbone = getattr(model, "backbone", model)
    patch = backbone.patch_size
    brightness = np.where(expert < 0, 0.0, 0.25 + 0.75 * expert / max(backbone.num_experts - 1, 1))
    fig = Figure(figsize=(1.6 * len(images), 3.4))
    axes = fig.subplots(2, len(images), squeeze=False)
    for i, image in enumerate(images):
        shown = np.clip((image + 1) / 2, 0, 1)
        axes[0, i].imshow(shown)
        axes[1, i].imshow(shown * np.kron(brightness[i], np.ones((patch, patch)))[..., None])
        for ax in axes[:, i]:
            ax.set_xticks([])
            ax.set_yticks([])
    axes[0, 0].set_ylabel("input")
    axes[1, 0].set_ylabel("by expert width")
    fig.suptitle(f"Tokens by expert (brightest: full expert) at e_c = {backbone.capacity:g}")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
