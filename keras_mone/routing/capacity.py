"""Capacity distributions over nested experts (MoNE paper, Sec. 4.3 and Table 2).

A capacity distribution ``c`` gives the fraction of tokens each nested expert
processes, ordered from the smallest expert (width ``D / 2**(E-1)``) to the
full one (width ``D``). Its *effective capacity* is
``e_c = sum_i c_i * d_i / D`` (Sec. 4.3), the fraction of the dense model's
projection FLOPs that the routed model spends.
"""

import functools
import math

import numpy as np

REALISED_CAPACITY_TOLERANCE = 0.02
"""Models warn when whole-token rounding moves the capacity further than this."""

_SOLVER_TOLERANCE = 1e-9


def expert_width_fractions(num_experts):
    """``d_i / D`` for ``i = 1..E``: ``[1/2**(E-1), ..., 1/2, 1]`` (Sec. 4.3)."""
    _check_num_experts(num_experts)
    return np.array([2.0 ** -(num_experts - 1 - i) for i in range(num_experts)])


def minimum_effective_capacity(num_experts):
    """Smallest reachable ``e_c`` when every token goes to some expert."""
    return float(expert_width_fractions(num_experts)[0])


def effective_capacity(capacities):
    """``e_c = sum_i c_i d_i / D`` of a distribution ordered small to large."""
    capacities = np.asarray(capacities, dtype=np.float64)
    return float(capacities @ expert_width_fractions(len(capacities)))


def validate_effective_capacity(value, num_experts=None, name="capacity"):
    """Returns ``value`` as a float, or raises a ``ValueError`` naming ``name``.

    Allowed: a finite number in ``(0, 1]``; with ``num_experts`` given, also at
    least the smallest expert's width fraction ``2**-(num_experts - 1)``.
    """
    if isinstance(value, (bool, np.bool_, str, bytes)):  # float("0.5") or float(True) would pass
        raise ValueError(f"`{name}` must be a number in (0, 1], got {value!r}.")
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"`{name}` must be a number in (0, 1], got {value!r}."
        ) from None
    if math.isnan(value) or not 0.0 < value <= 1.0:
        raise ValueError(f"`{name}` must be in (0, 1], got {value}.")
    if num_experts is not None:
        low = minimum_effective_capacity(num_experts)
        if value < low - _SOLVER_TOLERANCE:
            raise ValueError(
                f"`{name}`={value} is below {low:g}, the smallest effective "
                f"capacity that {num_experts} nested experts can reach (every "
                f"token at the smallest expert, width D/{2 ** (num_experts - 1)}). "
                f"Use a capacity in [{low:g}, 1] or more experts "
                f"(`num_experts`={_experts_needed(value)} reaches {value})."
            )
    return value


@functools.lru_cache(maxsize=256)
def _solve_eq3(e_c, num_experts, beta, delta):
    from scipy.optimize import minimize

    widths = expert_width_fractions(num_experts)
    # Eq. 3 exactly as printed: reward c_i / delta**(i - 1), i = 1 the smallest
    # expert. See ``capacity_distribution`` for why this, and not a reward
    # that grows with expert size, is what serves the text's intent.
    reward = delta ** -np.arange(num_experts, dtype=np.float64)

    def negative_objective(c):
        safe = np.clip(c, 1e-300, None)
        return -(reward @ c - beta * np.sum(c * np.log(safe)))

    def gradient(c):
        safe = np.clip(c, 1e-300, None)
        return -(reward - beta * (np.log(safe) + 1.0))

    constraints = [
        {"type": "eq", "fun": lambda c: np.sum(c) - 1.0, "jac": lambda c: np.ones_like(c)},
        {"type": "eq", "fun": lambda c: c @ widths - e_c, "jac": lambda c: widths},
    ]
    start = _interior_start(e_c, widths)
    result = minimize(
        negative_objective,
        start,
        jac=gradient,
        method="SLSQP",
        bounds=[(0.0, 1.0)] * num_experts,
        constraints=constraints,
        options={"ftol": 1e-15, "maxiter": 1000},
    )
    c = _project_onto_constraints(np.clip(result.x, 0.0, 1.0), e_c, widths)
    if not _feasible(c, e_c, widths):
        # SLSQP can fail just above the smallest capacity (e.g. e_c 0.036 with 6 experts:
        # "Inequality constraints incompatible"); the stationary point of the Lagrangian
        # is the same optimum (the problem is strictly concave), found in one dimension
        c = _solve_eq3_dual(e_c, widths, reward, beta)
        if not _feasible(c, e_c, widths):
            raise RuntimeError(
                f"SLSQP did not find a feasible capacity distribution for "
                f"effective_capacity={e_c}: {result.message}"
            )
    return tuple(np.clip(c, 0.0, 1.0))


def _feasible(c, e_c, widths):
    return not (np.any(c < -_SOLVER_TOLERANCE) or abs(c.sum() - 1.0) > 1e-9 or abs(c @ widths - e_c) > 1e-9)


def _solve_eq3_dual(e_c, widths, reward, beta):
    """Eq. 3's maximiser from its Lagrangian: ``c_i ~ exp((reward_i - lambda d_i / D) / beta)``,
    with ``lambda`` the root of ``sum_i c_i d_i / D = e_c`` (strictly decreasing in
    ``lambda``: its slope is minus the variance of the widths under ``c``, over beta)."""
    from scipy.optimize import brentq
    from scipy.special import softmax

    def mean_width(lam):
        return softmax((reward - lam * widths) / beta) @ widths - e_c

    low, high = -1.0, 1.0
    while mean_width(low) < 0:
        low *= 2.0
    while mean_width(high) > 0:
        high *= 2.0
    lam = brentq(mean_width, low, high, xtol=1e-14, rtol=1e-15, maxiter=500)
    return _project_onto_constraints(softmax((reward - lam * widths) / beta), e_c, widths)


def capacity_distribution(effective_capacity, num_experts=4, beta=10.0, delta=2.0):
    """Solves Eq. 3 of the MoNE paper for the per-expert capacities.

    maximise   sum_i c_i / delta**(i - 1)  -  beta * sum_i c_i log c_i
    subject to sum_i c_i = 1,  sum_i c_i d_i / D = e_c,  0 <= c_i <= 1

    with SLSQP, as in the paper (beta = 10, delta = 2); ``i = 1`` is the
    smallest expert.

    The printed linear term looks as if it rewarded the *smaller* experts,
    while Sec. 4.3 says the larger ones are incentivised. keras_mone solves
    Eq. 3 as printed, because on the feasible set only the part of the reward
    orthogonal to ``1`` and ``d / D`` matters: the "literal text" reward
    ``1 / delta**(E - i)`` equals ``d_i / D`` for delta = 2, is constant on the
    feasible set and would leave the maximum-entropy solution unchanged,
    whereas the printed reward moves capacity from the middle experts to the
    full one (and the smallest), i.e. it does incentivise the full expert
    relative to the entropy-only solution. Both facts are tested.

    Args:
        effective_capacity: ``e_c`` in ``[2**-(E-1), 1]``.
        num_experts: ``E``, the number of nested experts (widths D/2**(E-1)..D).
        beta: weight of the entropy term (> 0).
        delta: reward ratio between neighbouring experts (> 1).

    Returns:
        A float64 numpy array of ``E`` capacities, smallest expert first.
    """
    e_c = validate_effective_capacity(effective_capacity, num_experts, "effective_capacity")
    if not beta > 0:
        raise ValueError(f"`beta` must be > 0, got {beta}.")
    if not delta > 1:
        raise ValueError(f"`delta` must be > 1, got {delta}.")
    widths = expert_width_fractions(num_experts)
    # The two ends of the range have a single feasible point.
    if e_c >= 1.0 - _SOLVER_TOLERANCE:
        return np.eye(num_experts)[-1]
    if e_c <= widths[0] + _SOLVER_TOLERANCE:
        return np.eye(num_experts)[0]
    return np.array(_solve_eq3(e_c, num_experts, float(beta), float(delta)))


def uniform_distribution(num_experts=4):
    """Table 2 "Uniform": every expert gets ``1/E`` of the tokens (e_c 0.47 at E=4)."""
    _check_num_experts(num_experts)
    return np.full(num_experts, 1.0 / num_experts)


def proportionate_distribution(num_experts=4):
    """Table 2 "Proportionate": capacity inversely proportional to expert cost.

    ``c_i ∝ D / d_i`` (e_c = 4/15 ≈ 0.27 at E=4).
    """
    inverse_cost = 1.0 / expert_width_fractions(num_experts)
    return inverse_cost / inverse_cost.sum()


def greedy_distribution(effective_capacity, num_experts=4):
    """Table 2 "Greedy": the full expert takes as many tokens as the budget
    allows while every other token goes to the smallest expert."""
    e_c = validate_effective_capacity(effective_capacity, num_experts, "effective_capacity")
    return _greedy(e_c, expert_width_fractions(num_experts))


def mod_greedy_distribution(effective_capacity, num_experts=4):
    """Table 2 "MoD Greedy": the whole budget goes to the full expert and all
    other tokens are dropped (they skip the block, as in Mixture-of-Depths).

    The returned capacities sum to ``effective_capacity``; ``1 - sum`` is the
    fraction of dropped tokens.
    """
    e_c = validate_effective_capacity(effective_capacity, None, "effective_capacity")
    _check_num_experts(num_experts)
    c = np.zeros(num_experts)
    c[-1] = e_c
    return c


CAPACITY_DISTRIBUTIONS = {
    "mone": capacity_distribution,
    "greedy": greedy_distribution,
    "mod_greedy": mod_greedy_distribution,
}
"""Dynamic-budget distributions of tokens over experts, ``fn(effective_capacity, num_experts)``."""

STATIC_CAPACITY_DISTRIBUTIONS = {
    "uniform": uniform_distribution,
    "proportionate": proportionate_distribution,
}
"""Static-budget distributions of Table 2, ``fn(num_experts)``: each fixes its
own e_c (0.47 and 0.27 at E = 4), which is why the paper calls them inflexible."""

DISTRIBUTIONS = CAPACITY_DISTRIBUTIONS  # former name, kept for one release
STATIC_DISTRIBUTIONS = STATIC_CAPACITY_DISTRIBUTIONS  # former name, kept for one release

CAPACITY_METHODS = tuple(CAPACITY_DISTRIBUTIONS) + tuple(STATIC_CAPACITY_DISTRIBUTIONS)
"""Every ``capacity_method`` of MoNE models (Table 2's columns; "mone" = Eq. 3)."""

STATIC_CAPACITY_TOLERANCE = 0.005
"""A static method accepts a requested ``e_c`` this close to its own (Table
2 prints them to two decimals: 0.47 for 15/32, 0.27 for 4/15)."""


def static_effective_capacity(method, num_experts=4):
    """The e_c a static method runs at (``None`` for a dynamic-budget one)."""
    _check_method(method)
    if method not in STATIC_CAPACITY_DISTRIBUTIONS:
        return None
    return effective_capacity(STATIC_CAPACITY_DISTRIBUTIONS[method](num_experts))


def method_capacity(method, effective_capacity, num_experts=4):
    """The e_c that ``method`` runs at when asked for ``effective_capacity``.

    Dynamic methods run at the requested value (validated; "mod_greedy" may go
    below ``2**-(E-1)`` since it drops tokens). A static method runs at its own
    e_c and accepts only a request within ``STATIC_CAPACITY_TOLERANCE`` of it.
    """
    own = static_effective_capacity(method, num_experts)
    minimum = None if method == "mod_greedy" else num_experts
    requested = validate_effective_capacity(effective_capacity, minimum, "capacity")
    if own is None:
        return requested
    if abs(requested - own) > STATIC_CAPACITY_TOLERANCE:
        raise ValueError(
            f"`capacity_method`={method!r} fixes the effective capacity at {own:.6g} with "
            f"{num_experts} experts (a static budget, MoNE Table 2), got `capacity`={requested}. "
            f"Pass capacity={own:.6g}, or a dynamic method ({', '.join(CAPACITY_DISTRIBUTIONS)}) for other budgets."
        )
    return own


def distribution_for(method, effective_capacity, num_experts):
    """Capacities of a named method (see ``CAPACITY_METHODS``) at ``effective_capacity``."""
    if method in STATIC_CAPACITY_DISTRIBUTIONS:
        method_capacity(method, effective_capacity, num_experts)
        return STATIC_CAPACITY_DISTRIBUTIONS[method](num_experts)
    _check_method(method)
    return CAPACITY_DISTRIBUTIONS[method](effective_capacity, num_experts=num_experts)


def _check_method(method):
    if method not in CAPACITY_METHODS:
        raise ValueError(f"`capacity_method` must be one of {list(CAPACITY_METHODS)}, got {method!r}.")


def _greedy(e_c, widths):
    c = np.zeros(len(widths))
    c[-1] = (e_c - widths[0]) / (1.0 - widths[0])
    c[0] = 1.0 - c[-1]
    return c


def _interior_start(e_c, widths):
    """A feasible start with every entry > 0: uniform mixed with a greedy point."""
    uniform = np.full(len(widths), 1.0 / len(widths))
    for t in (0.5, 0.25, 0.1, 0.01):
        e_rest = (e_c - t * (uniform @ widths)) / (1.0 - t)
        if widths[0] < e_rest < 1.0:
            return t * uniform + (1.0 - t) * _greedy(e_rest, widths)
    return _greedy(e_c, widths)


def _project_onto_constraints(c, e_c, widths):
    """Euclidean projection of ``c`` onto {sum c = 1, c . widths = e_c}."""
    a = np.stack([np.ones_like(widths), widths])
    residual = a @ c - np.array([1.0, e_c])
    return c - a.T @ np.linalg.solve(a @ a.T, residual)


def _check_num_experts(num_experts):
    if not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
        raise ValueError(f"`num_experts` must be a positive integer, got {num_experts!r}.")


def _experts_needed(e_c):
    return max(1, int(math.ceil(1 - math.log2(e_c))))
