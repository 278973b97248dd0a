"""Independent float64 numpy re-implementation of MoNE (Jain et al., NeurIPS 2024).

Nothing here imports keras or keras_mone: every function is written from the
paper (Sec. 3.1, 4.1-4.3, Algorithm 1, App. A.1 Eq. 4-8), so the tests compare
the library against a second implementation rather than against itself.

Conventions shared with the library (they are layout choices, not maths):

* Expert ``0`` is the smallest (width ``D / 2**(E-1)``), expert ``E-1`` is
  the full model; ``-1`` marks a token no expert processes (MoD-style drop).
* The fused attention in-projection ``W_qkv`` has shape ``(D, 3D)``; its
  columns are ``[Q | K | V]`` and inside each of them the heads are
  contiguous blocks of ``head_dim`` columns (the big_vision / Keras layout).
* A "width" of ``0`` for a token means the token skips the block entirely.
"""

import math

import numpy as np
from scipy.special import erf

LAYER_NORM_EPSILON = 1e-6


# --------------------------------------------------------------------------
# elementary functions
# --------------------------------------------------------------------------
def gelu(x):
    """Exact GELU, ``x * Phi(x)`` with the Gaussian CDF via ``erf``."""
    x = np.asarray(x, dtype=np.float64)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def softmax(x, axis=-1):
    x = np.asarray(x, dtype=np.float64)
    shifted = x - x.max(axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=axis, keepdims=True)


def layer_norm(x, gamma, beta, epsilon=LAYER_NORM_EPSILON):
    x = np.asarray(x, dtype=np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + epsilon) * gamma + beta


def pad(x, width):
    """The paper's *Pad*: zero-pads the last axis to ``width``."""
    out = np.zeros(x.shape[:-1] + (width,), dtype=np.float64)
    out[..., : x.shape[-1]] = x
    return out


# --------------------------------------------------------------------------
# sliced projections (App. A.1 Eq. 7), one token at a time
# --------------------------------------------------------------------------
def in_projection(x, kernel, bias, width):
    """``x[:d] @ W[:d]`` (+ bias): a token of width ``d`` reads its first ``d`` features."""
    out = np.asarray(x, np.float64)[..., :width] @ np.asarray(kernel, np.float64)[:width]
    return out if bias is None else out + bias


def out_projection(x, kernel, bias, width):
    """``x @ W[:, :d]`` (+ bias[:d]), zero-padded back to the kernel's output width."""
    out = np.asarray(x, np.float64) @ np.asarray(kernel, np.float64)[:, :width]
    if bias is not None:
        out = out + np.asarray(bias, np.float64)[:width]
    return pad(out, kernel.shape[1])


def nested_dense(x, kernel, bias=None, in_width=None, out_width=None, pad_output=True):
    """NestedDense on an array ``(..., features)`` with one in/out width for all rows."""
    kernel = np.asarray(kernel, np.float64)
    in_width = kernel.shape[0] if in_width is None else in_width
    out_width = kernel.shape[1] if out_width is None else out_width
    out = np.asarray(x, np.float64)[..., :in_width] @ kernel[:in_width, :out_width]
    if bias is not None:
        out = out + np.asarray(bias, np.float64)[:out_width]
    return pad(out, kernel.shape[1]) if pad_output else out


def _per_token(fn, x, widths):
    """Applies ``fn(row, width)`` to every token ``x[b, n]`` with its width."""
    x = np.asarray(x, np.float64)
    widths = np.broadcast_to(np.asarray(widths), x.shape[:2])
    rows = [[fn(x[b, n], int(widths[b, n])) for n in range(x.shape[1])] for b in range(x.shape[0])]
    return np.array(rows, dtype=np.float64)


# --------------------------------------------------------------------------
# Eq. 5: self-attention with nested in/out projections, attention at full D
# --------------------------------------------------------------------------
def attention(x, widths, qkv_kernel, qkv_bias, out_kernel, out_bias, num_heads):
    """``x``: (batch, N, D); ``widths``: (batch, N) or scalar nested width per token.

    Q, K, V of token ``i`` come from ``x_i[:d_i] @ W[:d_i]`` and always have
    the full dimension ``D``; softmax per head scaled by ``1/sqrt(head_dim)``;
    the output of token ``i`` is ``attended_i @ W_o[:, :d_i]`` padded to ``D``.
    """
    x = np.asarray(x, np.float64)
    batch, tokens, dim = x.shape
    head_dim = dim // num_heads
    qkv = _per_token(lambda row, d: in_projection(row, qkv_kernel, qkv_bias, d), x, widths)
    q, k, v = (qkv[..., i * dim : (i + 1) * dim] for i in range(3))

    def heads(t):
        return t.reshape(batch, tokens, num_heads, head_dim).transpose(0, 2, 1, 3)

    q, k, v = heads(q), heads(k), heads(v)
    logits = q @ k.transpose(0, 1, 3, 2) / math.sqrt(head_dim)
    attended = softmax(logits, axis=-1) @ v  # (batch, heads, N, head_dim)
    attended = attended.transpose(0, 2, 1, 3).reshape(batch, tokens, dim)
    return _per_token(lambda row, d: out_projection(row, out_kernel, out_bias, d), attended, widths)


# --------------------------------------------------------------------------
# Eq. 6: MLP, hidden width always mlp_dim
# --------------------------------------------------------------------------
def mlp(x, widths, fc1_kernel, fc1_bias, fc2_kernel, fc2_bias):
    def token(row, d):
        hidden = gelu(in_projection(row, fc1_kernel, fc1_bias, d))
        return out_projection(hidden, fc2_kernel, fc2_bias, d)

    return _per_token(token, x, widths)


# --------------------------------------------------------------------------
# Eq. 1 block (pre-LayerNorm) with Eq. 8 per-token widths
# --------------------------------------------------------------------------
def block(x, widths, params, gates=None, alpha=0.0, epsilon=LAYER_NORM_EPSILON):
    """One MoNE block.

    ``z = x + Pad(SA_d(LN1(x)))``;  ``x' = z + (alpha * r + 1) * Pad(FFN_d(LN2(z)))``.

    Args:
        x: (batch, N, D).
        widths: (batch, N) nested width of every token; ``0`` = the token is
            dropped and skips the block (it is neither query nor key).
        params: dict with norm1_gamma/beta, qkv_kernel/bias, out_kernel/bias,
            norm2_gamma/beta, fc1_kernel/bias, fc2_kernel/bias.
        gates: (batch, N) router probability ``r`` of each token's expert, or
            None for a gate factor of 1.
        alpha: the block's alpha.
    """
    x = np.asarray(x, np.float64)
    widths = np.broadcast_to(np.asarray(widths), x.shape[:2])
    out = x.copy()
    p = params
    for b in range(x.shape[0]):
        active = widths[b] > 0
        if not active.any():  # every token dropped: the block is skipped
            continue
        xa = x[b : b + 1, active]
        wa = widths[b : b + 1, active]
        h = layer_norm(xa, p["norm1_gamma"], p["norm1_beta"], epsilon)
        z = xa + attention(
            h, wa, p["qkv_kernel"], p["qkv_bias"], p["out_kernel"], p["out_bias"], p["num_heads"]
        )
        h = layer_norm(z, p["norm2_gamma"], p["norm2_beta"], epsilon)
        update = mlp(h, wa, p["fc1_kernel"], p["fc1_bias"], p["fc2_kernel"], p["fc2_bias"])
        if gates is not None:
            scale = alpha * np.asarray(gates, np.float64)[b : b + 1, active] + 1.0
            update = update * scale[..., None]
        out[b, active] = (z + update)[0]
    return out


# --------------------------------------------------------------------------
# Algorithm 1: Expert Preferred Routing
# --------------------------------------------------------------------------
def token_counts(capacities, num_tokens):
    """``(k_1..k_E, dropped)`` per Sec. 4.2: ``k_j = floor(c_j N)`` for the larger
    experts, leftovers to the smallest (Alg. 1 line 1). If the capacities sum
    to less than one (MoD greedy), the smallest also gets ``floor(c_1 N)`` and
    the remaining tokens are dropped.

    ``c_j N`` is floored after rounding away binary representation error
    (1e-9), so that ``c = 0.57, N = 100`` gives 57 tokens (``0.57 * 100`` is
    56.99999999999999 in float64; ``0.3 * 10`` is exactly 3.0 and needs no rounding).
    """
    c = [float(v) for v in capacities]

    def floor(v):
        return int(math.floor(round(v, 9)))

    counts = [floor(cj * num_tokens) for cj in c]
    if sum(c) > 1.0 - 1e-6:
        counts[0] = num_tokens - sum(counts[1:])
    return counts, num_tokens - sum(counts)


def expert_preferred_routing(router_probs, capacities):
    """Algorithm 1 on each example; ties go to the lower token index and
    non-finite probabilities (NaN, inf) rank below every finite one.

    Args:
        router_probs: (batch, N, E).
        capacities: E capacities, smallest expert first.

    Returns:
        int (batch, N) expert index per token, ``-1`` for dropped tokens.
    """
    probs = np.asarray(router_probs, np.float64)
    probs = np.where(np.isfinite(probs), probs, -1.0)
    batch, tokens, experts = probs.shape
    counts, _ = token_counts(capacities, tokens)
    assignment = np.full((batch, tokens), -1, dtype=np.int64)
    for b in range(batch):
        free = np.ones(tokens, dtype=bool)
        for j in reversed(range(experts)):
            if counts[j] == 0:
                continue
            # "Null out assigned ones" with -inf, not 0: a probability can be 0.
            scores = np.where(free, probs[b, :, j], -np.inf)
            chosen = np.argsort(-scores, kind="stable")[: counts[j]]
            assert free[chosen].all()
            assignment[b, chosen] = j
            free[chosen] = False
    return assignment


def check_valid_epr(router_probs, capacities, assignment):
    """Checks that ``assignment`` is *an* output of Algorithm 1 (any tie-breaking).

    Replays the algorithm from the largest expert to the smallest: each expert
    must get exactly ``k_j`` tokens, all still unassigned at its turn, and the
    multiset of their probabilities must equal the top-``k_j`` multiset among
    the unassigned tokens. Raises ``AssertionError`` with details otherwise.
    """
    probs = np.asarray(router_probs, np.float64)
    assignment = np.asarray(assignment)
    batch, tokens, experts = probs.shape
    counts, dropped = token_counts(capacities, tokens)
    for b in range(batch):
        free = np.ones(tokens, dtype=bool)
        for j in reversed(range(experts)):
            chosen = np.flatnonzero(assignment[b] == j)
            assert len(chosen) == counts[j], (b, j, len(chosen), counts[j])
            if not counts[j]:
                continue
            assert free[chosen].all(), f"example {b}: expert {j} re-used assigned tokens"
            got = np.sort(probs[b, chosen, j])
            best = np.sort(probs[b, free, j])[-counts[j]:]
            np.testing.assert_array_equal(
                got, best, err_msg=f"example {b}: expert {j} did not take a top-{counts[j]}"
            )
            free[chosen] = False
        assert int((assignment[b] == -1).sum()) == dropped, (b, dropped)
        assert free.sum() == dropped


# --------------------------------------------------------------------------
# Whole backbone (Eq. 8: each token at its expert's width)
# --------------------------------------------------------------------------
def patch_embedding(images, kernel, bias, class_token, position_embedding, patch_size):
    """Non-overlapping ``p x p`` patches (row-major), linear projection, optional
    class token in front, plus position embeddings."""
    images = np.asarray(images, np.float64)
    batch, height, width, channels = images.shape
    p = patch_size
    gh, gw = height // p, width // p
    patches = images.reshape(batch, gh, p, gw, p, channels).transpose(0, 1, 3, 2, 4, 5)
    patches = patches.reshape(batch, gh * gw, p * p * channels)
    tokens = patches @ np.asarray(kernel, np.float64).reshape(p * p * channels, -1) + bias
    if class_token is not None:
        cls = np.broadcast_to(np.asarray(class_token, np.float64).reshape(1, 1, -1), (batch, 1, tokens.shape[-1]))
        tokens = np.concatenate([cls, tokens], axis=1)
    return tokens + np.asarray(position_embedding, np.float64)


def block_params(weights, index, num_heads):
    """Block ``index``'s parameters from a ``{relative path: array}`` dict."""
    prefix = f"block_{index}/"
    names = {
        "norm1_gamma": "norm1/gamma", "norm1_beta": "norm1/beta",
        "qkv_kernel": "attention/qkv/kernel", "qkv_bias": "attention/qkv/bias",
        "out_kernel": "attention/out/kernel", "out_bias": "attention/out/bias",
        "norm2_gamma": "norm2/gamma", "norm2_beta": "norm2/beta",
        "fc1_kernel": "mlp/fc1/kernel", "fc1_bias": "mlp/fc1/bias",
        "fc2_kernel": "mlp/fc2/kernel", "fc2_bias": "mlp/fc2/bias",
    }
    params = {k: np.asarray(weights[prefix + v], np.float64) for k, v in names.items()}
    params["num_heads"] = num_heads
    return params


def vit_forward(
    weights,
    images,
    *,
    patch_size,
    depth,
    num_heads,
    num_experts=4,
    router_positions=(),
    expert_index=(),
    learned_router=True,
    use_class_token=False,
    epsilon=LAYER_NORM_EPSILON,
):
    """Dense ViT or MoNE-ViT forward pass.

    Blocks before the first router run at full width without gate. At each
    router position the token assignment switches to the next entry of
    ``expert_index`` ((batch, N) expert per token, original token order, as
    the library reports it; -1 = dropped) and holds until the next router.
    With ``learned_router`` the router ``softmax(W x + b)`` is evaluated here
    on the block input and its probability of the token's expert is the gate
    of Eq. 1; every block from the first router on has an ``alpha``.

    Returns:
        ``(tokens after the final LayerNorm, [router probabilities per router])``.
    """
    x = patch_embedding(
        images,
        weights["patch_embedding/projection/kernel"],
        weights["patch_embedding/projection/bias"],
        weights.get("patch_embedding/class_token") if use_class_token else None,
        weights["patch_embedding/position_embedding"],
        patch_size,
    )
    return encoder_forward(
        weights, x, depth=depth, num_heads=num_heads, num_experts=num_experts,
        router_positions=router_positions, expert_index=expert_index,
        learned_router=learned_router, epsilon=epsilon,
    )


def encoder_forward(
    weights,
    x,
    *,
    depth,
    num_heads,
    num_experts=4,
    router_positions=(),
    expert_index=(),
    learned_router=True,
    epsilon=LAYER_NORM_EPSILON,
):
    """The blocks and final LayerNorm of ``vit_forward`` on embedded tokens ``x``."""
    hidden_dim = weights["norm/gamma"].shape[0]
    expert_widths = [hidden_dim // 2 ** (num_experts - 1 - j) for j in range(num_experts)]
    batch, tokens, _ = x.shape
    widths = np.full((batch, tokens), hidden_dim)
    gates = None
    all_probs = []
    routers = dict(zip(router_positions, expert_index))
    for index in range(depth):
        alpha = 0.0
        if index in routers:
            assignment = np.asarray(routers[index])
            widths = np.where(assignment >= 0, np.take(expert_widths, np.maximum(assignment, 0)), 0)
            if learned_router:
                probs = softmax(
                    x @ weights[f"router_{index}/dense/kernel"] + weights[f"router_{index}/dense/bias"]
                )
                all_probs.append(probs)
                gates = np.take_along_axis(probs, np.maximum(assignment, 0)[..., None], axis=-1)[..., 0]
        if router_positions and index >= min(router_positions):
            alpha = float(weights[f"block_{index}/alpha"])
        x = block(x, widths, block_params(weights, index, num_heads), gates=gates, alpha=alpha, epsilon=epsilon)
    return layer_norm(x, weights["norm/gamma"], weights["norm/beta"], epsilon), all_probs


# --------------------------------------------------------------------------
# ViViT factorised encoder (Arnab et al. 2021, Model 3)
# --------------------------------------------------------------------------
def tubelet_embedding(videos, kernel, bias, class_token, position_embedding):
    """Non-overlapping ``t x p x p`` tubelets (time-major, then row-major), linear
    projection; one sequence per frame index, rows ``b * T/t + f``."""
    videos = np.asarray(videos, np.float64)
    batch, frames, height, width, channels = videos.shape
    t, p = kernel.shape[0], kernel.shape[1]
    tubes = videos.reshape(batch, frames // t, t, height // p, p, width // p, p, channels)
    tubes = tubes.transpose(0, 1, 3, 5, 2, 4, 6, 7)  # (b, f, gh, gw, t, p, p, c)
    tubes = tubes.reshape(batch * (frames // t), (height // p) * (width // p), t * p * p * channels)
    tokens = tubes @ np.asarray(kernel, np.float64).reshape(t * p * p * channels, -1) + bias
    if class_token is not None:
        cls = np.broadcast_to(np.asarray(class_token, np.float64).reshape(1, 1, -1), (tokens.shape[0], 1, tokens.shape[-1]))
        tokens = np.concatenate([cls, tokens], axis=1)
    return tokens + np.asarray(position_embedding, np.float64)


def vivit_forward(weights, videos, *, depth, temporal_depth, num_heads, use_class_token=True, **routing):
    """Dense ViViT-FE or MoNE-ViViT-FE forward pass (``routing`` as in ``encoder_forward``,
    with ``expert_index`` per frame index: (batch * T/t, N))."""
    batch = np.shape(videos)[0]
    x = tubelet_embedding(
        videos,
        weights["tubelet_embedding/projection/kernel"],
        weights["tubelet_embedding/projection/bias"],
        weights.get("tubelet_embedding/class_token") if use_class_token else None,
        weights["tubelet_embedding/position_embedding"],
    )
    spatial, _ = encoder_forward(weights, x, depth=depth, num_heads=num_heads, **routing)
    frames = spatial[:, 0] if use_class_token else spatial.mean(axis=1)
    frames = frames.reshape(batch, -1, frames.shape[-1])
    temporal = {k[len("temporal_encoder/"):]: v for k, v in weights.items() if k.startswith("temporal_encoder/")}
    if use_class_token:
        cls = np.broadcast_to(temporal["class_token"].reshape(1, 1, -1), (batch, 1, frames.shape[-1]))
        frames = np.concatenate([cls, frames], axis=1)
    frames = frames + temporal["position_embedding"]
    out, _ = encoder_forward(temporal, frames, depth=temporal_depth, num_heads=num_heads)
    return out


# --------------------------------------------------------------------------
# Eq. 3: capacity distribution, solved in closed form
# --------------------------------------------------------------------------
def width_fractions(num_experts):
    """``d_i / D = 2**-(E - i)`` for ``i = 1..E``."""
    return 2.0 ** -np.arange(num_experts - 1, -1, -1, dtype=np.float64)


def entropy_regularised_optimum(e_c, reward, beta=10.0):
    """The unique maximiser of ``reward @ c - beta * sum c log c`` subject to
    ``sum c = 1`` and ``c @ w = e_c`` (w = width fractions), for ``w_1 < e_c < 1``.

    The objective is strictly concave and its gradient is infinite at
    ``c_i = 0``, so the optimum is interior and the KKT conditions give the
    Gibbs form ``c_i ∝ exp((reward_i - mu * w_i) / beta)``; ``c @ w`` is
    strictly decreasing in ``mu``, so one bisection (``brentq``) pins it.
    """
    from scipy.optimize import brentq

    reward = np.asarray(reward, np.float64)
    w = width_fractions(len(reward))

    def c_of(mu):
        z = (reward - mu * w) / beta
        c = np.exp(z - z.max())
        return c / c.sum()

    mu = brentq(lambda m: c_of(m) @ w - e_c, -1e5, 1e5, xtol=1e-13, rtol=4 * np.finfo(float).eps, maxiter=1000)
    return c_of(mu)


def eq3_objective(c, reward, beta=10.0):
    c = np.asarray(c, np.float64)
    safe = np.where(c > 0, c, 1.0)
    return float(np.asarray(reward) @ c - beta * np.sum(np.where(c > 0, c * np.log(safe), 0.0)))
