r"""Hypothesis strategies for the inputs of a Stable LatentMoE layer.

Every check of the kit draws its inputs from the strategies below, and they
are public so that a test suite can draw the same inputs for its own
properties:

```python
from hypothesis import given
from refimpl.testing import strategies as rst

@given(rst.routing_cases(distinct=True))
def test_my_router_picks_k_experts(case):
    index, weights = my_router(case.scores, case.bias, case.top_k)
    assert index.shape == (case.m, case.top_k)
```

All arrays are NumPy arrays. Sizes stay small (a few tokens, a few experts)
because Hypothesis finds bugs by trying many small inputs and then
**shrinking** a failing one to the simplest input that still fails.

**Inputs without ties, without `assume`.** Routing is discontinuous: when two
biased scores $s_{i,j} + b_j$ tie, or nearly tie, the top-$k$ depends on tie
order and on rounding, and two correct routers may disagree. The
`distinct=True` cases avoid that by construction instead of by rejection.
With $N = mn$ score entries, the scores are a shuffled grid and the bias has a
fractional part that is different for every expert:

$$
s_{i,j} = \frac{\pi_{i,j} + 1}{N + 1},
\qquad
b_j = \frac{c_j + \tau_j / (n + 1)}{N + 1},
$$

where $\pi$ is a permutation of $0, \dots, N-1$, the $c_j$ are integers and
$\tau$ is a permutation of $1, \dots, n$. Then
$(N+1)(s_{i,j} + b_j) = \pi_{i,j} + 1 + c_j + \tau_j/(n+1)$, whose fractional
part $\tau_j/(n+1)$ differs between any two experts: no two biased scores of a
token are equal, and any two differ by at least $1/((N+1)(n+1))$. The grid
may also be squeezed into a narrow band around 1/2 (scale $s - 1/2$ and $b$ by
the same factor), down to a guaranteed gap of $2^{-14}$: still far more than
float32 rounding, even after a common shift of the bias by 100, and far less
than bfloat16 can resolve. A batch too large for one such grid to keep that
gap gets a grid per token instead (see `routing_cases`).

**Inputs with many ties.** `ties=True` cases put scores and biases on a grid
of eighths, which float32 and bfloat16 represent exactly, so ties are exact
and tie order is the only thing that can differ.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st

from .._lib.values import switch_value
from ..config import MoEConfig
from ..layer.latent_moe import init_params

__all__ = [
    "BalancerCase",
    "ForwardCase",
    "Partition",
    "RoutingCase",
    "balancer_cases",
    "batch_sequences",
    "bias_shifts",
    "biases",
    "checked_switches",
    "configs",
    "forward_cases",
    "min_tokens_for_update",
    "partitions",
    "routing_cases",
    "routing_sizes",
    "scores",
    "token_batches",
]


# ---------------------------------------------------------------------------
# The values the strategies produce
# ---------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class RoutingCase:
    """One routing input: scores `[m, n]` in (0, 1), a bias `[n]` and `top_k`."""

    scores: np.ndarray
    bias: np.ndarray
    top_k: int

    @property
    def m(self) -> int:
        """Tokens in the batch."""
        return int(self.scores.shape[0])

    @property
    def n(self) -> int:
        """Routed experts."""
        return int(self.scores.shape[1])

    def astype(self, dtype: Any) -> RoutingCase:
        """The same case with scores and bias cast to `dtype`."""
        return RoutingCase(self.scores.astype(dtype), self.bias.astype(dtype), self.top_k)


@dataclass(frozen=True, eq=False)
class Partition:
    """How the tokens of a batch are spread over ranks and micro-batches.

    `blocks[r][a]` holds the token ids (rows of the batch) that rank `r`
    processes in micro-batch `a`. Every token appears in exactly one block.
    """

    blocks: tuple[tuple[np.ndarray, ...], ...]

    @property
    def ranks(self) -> int:
        """Number of ranks."""
        return len(self.blocks)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per rank."""
        return len(self.blocks[0]) if self.blocks else 0

    def split(self, batch: np.ndarray) -> list[np.ndarray]:
        """The rows of `batch` for every block, rank by rank: the `blocks` argument of Appendix D."""
        return [batch[ids] for rank in self.blocks for ids in rank]

    def __repr__(self) -> str:
        rows = "; ".join(
            f"rank {r}: " + " | ".join(str(ids.tolist()) for ids in rank) for r, rank in enumerate(self.blocks))
        return f"Partition({rows})"


@dataclass(frozen=True, eq=False)
class ForwardCase:
    """One forward-pass input: a config, a batch `x` `[m, d]` and the random seed of its parameters.

    The parameters are rebuilt from that seed with `params()`, so a failure
    report stays short and the case can be reproduced exactly.
    """

    config: MoEConfig
    x: np.ndarray
    param_seed: int
    bias_scale: float = 0.1

    def params(self, dtype: Any = np.float64) -> dict[str, np.ndarray]:
        """The layer's weights: `init_params(config, param_seed)` cast to `dtype`.

        The router bias stays in float32 when `dtype` is a half type, as Eq. (13)
        requires (a half-precision bias changes the top-k).
        """
        params = init_params(self.config, self.param_seed, dtype=np.float64, bias_scale=self.bias_scale)
        half = np.dtype(dtype).itemsize < 4
        return {name: value.astype(np.float32 if half and name == "gate.e_score_correction_bias" else dtype)
                for name, value in params.items()}


@dataclass(frozen=True, eq=False)
class BalancerCase:
    """A stream of batches for a stateful balancer: `batches[t]` is `[m_t, n]`."""

    batches: tuple[np.ndarray, ...]
    top_k: int
    initial_bias: np.ndarray

    @property
    def n(self) -> int:
        """Routed experts."""
        return int(self.initial_bias.shape[0])


# ---------------------------------------------------------------------------
# Switches, checked when a strategy is built
# ---------------------------------------------------------------------------

def checked_switches(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Check the keyword switches `names` of a strategy when the strategy is built, not when it is drawn from.

    `routing_cases(ties="false")` is refused on the spot, naming `ties`: a switch is a real boolean
    (`refimpl._lib.values.switch_value`), and a composite strategy's body runs only once Hypothesis draws.
    """
    def wrap(strategy: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(strategy)
        def built(*args: Any, **kwargs: Any) -> Any:
            for name in names:
                if name in kwargs:
                    switch_value(kwargs[name], name)
            return strategy(*args, **kwargs)
        return built
    return wrap


# ---------------------------------------------------------------------------
# Sizes and configurations
# ---------------------------------------------------------------------------

def min_tokens_for_update(n: int, top_k: int, *, integer_q: bool = False) -> int:
    r"""The fewest tokens for which Eq. (14) is defined: $\lceil q \rceil + 1 \le m$ with $q = mk/n$.

    The update reads the $(q+1)$-th largest margin of each expert, which needs
    that many tokens (about $n/(n-k)$). With `integer_q=True` the answer is
    also a multiple of $n/\gcd(n, k)$, so that $q$ is an integer.
    """
    integer_q = switch_value(integer_q, "integer_q")
    if not 1 <= top_k < n:
        raise ValueError(f"min_tokens_for_update needs 1 <= top_k < n, got top_k={top_k}, n={n}")
    step = n // int(np.gcd(n, top_k)) if integer_q else 1
    m = step
    while -(-m * top_k // n) + 1 > m:  # ceil(mk/n) + 1 > m
        m += step
    return m


@checked_switches("allow_all_experts", "integer_q", "for_update")
@st.composite
def routing_sizes(draw: st.DrawFn, *, max_tokens: int = 12, min_experts: int = 2, max_experts: int = 10,
                  allow_all_experts: bool = False, integer_q: bool = False,
                  for_update: bool = False) -> tuple[int, int, int]:
    r"""Sizes `(m, n, k)` with `1 <= k <= n` (`k < n` unless `allow_all_experts`).

    * `integer_q=True`: the target load $q = mk/n$ is an integer ($m$ is a
      multiple of $n / \gcd(n, k)$);
    * `for_update=True`: `k < n` and enough tokens for Eq. (14)
      (`min_tokens_for_update`), even if that exceeds `max_tokens`.
    """
    if not 1 <= min_experts <= max_experts:
        raise ValueError(f"routing_sizes: min_experts must be at least 1 and at most max_experts ({max_experts}), "
                         f"got {min_experts}")
    n = draw(st.integers(min_experts, max_experts), label="n")
    k = draw(st.integers(1, n if allow_all_experts and not for_update else n - 1), label="k")
    step = n // int(np.gcd(n, k)) if integer_q else 1
    low = min_tokens_for_update(n, k, integer_q=integer_q) if for_update else step
    high = max(low, max_tokens - max_tokens % step)
    m = low + step * draw(st.integers(0, (high - low) // step), label="extra tokens / step")
    return m, n, k


@checked_switches("vary_switches")
@st.composite
def configs(draw: st.DrawFn, *, max_experts: int = 8, max_width: int = 12, vary_switches: bool = False) -> MoEConfig:
    """Small `MoEConfig`s: a few experts, widths of a few units.

    By default only the sizes vary and the switches are K3's (SiTU-GLU,
    latent RMSNorm on, renormalized weights, scaling factor 1, one group).
    `vary_switches=True` also draws the activation, the norm switch, the
    renormalization and the routed scaling factor.
    """
    n = draw(st.integers(2, max_experts), label="num_experts")
    k = draw(st.integers(1, n), label="top_k")
    ell = draw(st.integers(1, max_width), label="latent_size")
    d = draw(st.integers(ell, max(ell, max_width)), label="hidden_size")
    f = draw(st.integers(1, max_width), label="intermediate_size")
    shared = draw(st.integers(0, 2), label="num_shared_experts")
    fields: dict[str, Any] = dict(hidden_size=d, latent_size=ell, num_experts=n, top_k=k,
                                  intermediate_size=f, num_shared_experts=shared, num_moe_layers=1)
    if vary_switches:
        fields["activation"] = draw(st.sampled_from(["situ", "swiglu"]), label="activation")
        fields["use_latent_norm"] = draw(st.booleans(), label="use_latent_norm")
        fields["renormalize"] = draw(st.booleans(), label="renormalize")
        fields["routed_scaling_factor"] = draw(st.sampled_from([1.0, 2.5]), label="routed_scaling_factor")
    return MoEConfig(**fields)


# ---------------------------------------------------------------------------
# Scores, biases, shifts
# ---------------------------------------------------------------------------

@checked_switches("distinct", "ties")
@st.composite
def scores(draw: st.DrawFn, m: int, n: int, *, distinct: bool = False, ties: bool = False,
           dtype: Any = np.float64) -> np.ndarray:
    r"""Router scores `[m, n]` strictly inside (0, 1).

    * default: independent floats in $[2^{-10}, 1 - 2^{-10}]$;
    * `distinct=True`: the shuffled grid $(\pi + 1)/(mn + 1)$, every entry different;
    * `ties=True`: multiples of 1/8, so equal scores are common and exact.
    """
    if distinct and ties:
        raise ValueError("scores: choose at most one of distinct=True and ties=True")
    if distinct:
        pi = np.array(draw(st.permutations(range(m * n)), label="score ranks"), dtype=np.float64)
        s = (pi + 1.0) / (m * n + 1.0)
    elif ties:
        eighths = draw(st.lists(st.integers(1, 7), min_size=m * n, max_size=m * n), label="eighths")
        s = np.array(eighths, dtype=np.float64) / 8.0
    else:
        values = draw(st.lists(st.floats(2.0**-10, 1.0 - 2.0**-10), min_size=m * n, max_size=m * n),
                      label="scores")
        s = np.array(values, dtype=np.float64)
    return s.reshape(m, n).astype(dtype)


@st.composite
def biases(draw: st.DrawFn, n: int, *, scale: float = 1.0, offset: float = 0.0,
           dtype: Any = np.float64) -> np.ndarray:
    """A bias `[n]`: floats in `[offset - scale, offset + scale]`.

    A bias far from zero (`offset=10`) is what a bias looks like after many
    uncentred updates; the reference routes it exactly like the centred one.
    """
    values = draw(st.lists(st.floats(-scale, scale), min_size=n, max_size=n), label="bias")
    return (np.array(values, dtype=np.float64) + offset).astype(dtype)


def bias_shifts(max_abs: float = 100.0) -> st.SearchStrategy[float]:
    """A non-zero common shift $c$ of the bias, up to `max_abs` in size (10 and 100 are tried first).

    Eq. (13) selects by $s_i + b$, so $b + c$ selects the same experts; a
    router that stores or adds the bias in low precision does not.
    """
    if isinstance(max_abs, bool) or not isinstance(max_abs, int | float) or not 0 < max_abs < float("inf"):
        raise ValueError(f"bias_shifts: max_abs must be a finite number > 0 (a shift of zero checks nothing), "
                         f"got {max_abs!r}")
    special = st.sampled_from([v for v in (10.0, -10.0, 100.0, 0.5) if abs(v) <= max_abs])
    general = st.floats(-max_abs, max_abs).map(lambda c: c if c != 0.0 else max_abs)
    return st.one_of(special, general)


def _checked_routing_sizes(strategy: Callable[..., Any]) -> Callable[..., Any]:
    """Check `routing_cases`' sizes and resolution when the strategy is built, naming the argument at fault."""
    @functools.wraps(strategy)
    def built(*args: Any, **kwargs: Any) -> Any:
        high = kwargs.get("max_experts", 10)  # min_experts is `routing_sizes`' to refuse, with the sizes drawn
        if kwargs.get("for_update", False) and high < 2:
            raise ValueError(f"routing_cases: for_update=True needs top_k < n, so max_experts >= 2, got {high}")
        if kwargs.get("distinct", True) and not kwargs.get("ties", False):
            resolution = kwargs.get("resolution", 2.0**-14)
            if not 0 < resolution or (high + 1.0) ** 2 * resolution > 1.0:
                raise ValueError(f"routing_cases: a gap of resolution={resolution!r} between the biased scores of "
                                 f"max_experts={high} experts does not fit scores in (0, 1): it needs "
                                 "0 < resolution <= 1 / (max_experts + 1)^2")
        return strategy(*args, **kwargs)
    return built


@_checked_routing_sizes
@checked_switches("distinct", "ties", "allow_all_experts", "integer_q", "for_update")
@st.composite
def routing_cases(draw: st.DrawFn, *, max_tokens: int = 12, min_experts: int = 2, max_experts: int = 10,
                  distinct: bool = True, ties: bool = False, allow_all_experts: bool = True, integer_q: bool = False,
                  for_update: bool = False, resolution: float = 2.0**-14, bias_offset: float = 0.0,
                  dtype: Any = np.float64) -> RoutingCase:
    """A `RoutingCase`: scores, a bias and `top_k`, drawn together.

    * `distinct=True` (default): no two biased scores $s_{i,j} + b_j$ of a
      token are equal or closer than `resolution` (see the module text). The
      grid is drawn either over the whole of (0, 1) or squeezed into a narrow
      band around 1/2 whose gaps are exactly `resolution`: trained routers'
      scores crowd together like that, and it is where low precision bites.
      The default $2^{-14}$ is wide enough for any float32 router, even with
      the bias shifted by 100, and far too fine for bfloat16. When one grid
      over the batch cannot keep that gap ($(mn + 1)(n + 1)$ above
      1/`resolution`), each token gets a grid of its own over its $n$
      experts, which keeps it for up to 1/sqrt(`resolution`) - 1 experts
      (127 for the default); more is a `ValueError` naming
      `max_experts`, refused when the strategy is built.
    * `ties=True`: scores and bias on a grid of eighths, with exact ties;
    * both false: independent floats (near-ties possible).

    `bias_offset` is added to every bias (the construction stays tie-free).
    `min_experts`, `allow_all_experts`, `integer_q` and `for_update` are those of `routing_sizes`.
    """
    m, n, k = draw(routing_sizes(max_tokens=max_tokens, min_experts=min_experts, max_experts=max_experts,
                                 allow_all_experts=allow_all_experts, integer_q=integer_q,
                                 for_update=for_update))
    if ties:
        s = draw(scores(m, n, ties=True))
        b = np.array(draw(st.lists(st.integers(-4, 4), min_size=n, max_size=n), label="bias eighths")) / 8.0
    elif distinct and resolution * (m * n + 1.0) * (n + 1.0) > 1.0:
        # Too many entries for one grid over the batch to keep `resolution` within (0, 1): each token gets a
        # grid of its own, $(\pi_{i,j} + 1)/(n + 1)$ with $\pi_i$ a permutation of $0, \dots, n-1$, and the
        # bias $(c_j + \tau_j/(n + 1))/(n + 1)$, so two biased scores of a token differ by $1/(n + 1)^2$ or more.
        step = n + 1.0
        grid = np.array([draw(st.permutations(range(n)), label=f"score ranks of token {i}") for i in range(m)],
                        dtype=np.float64).reshape(m, n)
        grid = (grid + 1.0) / step
        c = np.array(draw(st.lists(st.integers(-n, n), min_size=n, max_size=n), label="bias steps"))
        tau = np.array(draw(st.permutations(range(1, n + 1)), label="bias fractions"), dtype=np.float64)
        width = draw(st.sampled_from([1.0, resolution * step * step]), label="band width")
        s = 0.5 + width * (grid - 0.5)
        b = width * (c + tau / step) / step
    elif distinct:
        big_n = m * n + 1.0
        grid = draw(scores(m, n, distinct=True))  # (pi + 1) / (mn + 1)
        c = np.array(draw(st.lists(st.integers(-m * n, m * n), min_size=n, max_size=n), label="bias steps"))
        tau = np.array(draw(st.permutations(range(1, n + 1)), label="bias fractions"), dtype=np.float64)
        # Width of the band the grid is squeezed into: 1 (all of (0, 1)) or just enough for `resolution` (at
        # most 1: the batch's grid is used only when it keeps `resolution`, see the branch above).
        narrow = resolution * big_n * (n + 1.0)
        width = draw(st.sampled_from([1.0, narrow]), label="band width")
        # $$s_{i,j} = \tfrac12 + w\,\bigl((\pi_{i,j} + 1)/(mn + 1) - \tfrac12\bigr)$$
        s = 0.5 + width * (grid - 0.5)
        # $$b_j = w\,(c_j + \tau_j / (n + 1)) / (mn + 1)$$
        b = width * (c + tau / (n + 1.0)) / big_n
    else:
        s = draw(scores(m, n))
        b = draw(biases(n, scale=0.5))
    b = b.astype(np.float64) + bias_offset
    return RoutingCase(s.astype(dtype), b.astype(dtype), k)


# ---------------------------------------------------------------------------
# Batches of tokens, forward-pass inputs, partitions, streams
# ---------------------------------------------------------------------------

@st.composite
def token_batches(draw: st.DrawFn, m: int, d: int, *, dtype: Any = np.float64) -> np.ndarray:
    """A batch of tokens `x` `[m, d]` with entries from a small palette of unit-scale values.

    The palette (1, -1, 0.5, -0.5, 2, -2, 0.25, -0.25, 1.5, -1.5, 0.75,
    -0.75, 0) is exact in bfloat16 and keeps printed failures short.
    Hypothesis shrinks towards the front of the palette, so a shrunk input
    has entries of size one, like real activations, rather than tiny ones
    whose error would sit just above the tolerance.
    """
    values = draw(st.lists(st.sampled_from(_PALETTE), min_size=m * d, max_size=m * d), label="x")
    return np.array(values, dtype=np.float64).reshape(m, d).astype(dtype)


_PALETTE = (1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25, -0.25, 1.5, -1.5, 0.75, -0.75, 0.0)


@st.composite
def forward_cases(draw: st.DrawFn, *, config: MoEConfig | st.SearchStrategy[MoEConfig] | None = None,
                  max_tokens: int = 6, bias_scale: float = 0.1, dtype: Any = np.float64) -> ForwardCase:
    """A `ForwardCase`: a small config (or the one given), a batch `x` and a parameter seed."""
    if config is None:
        config = configs()
    if isinstance(config, st.SearchStrategy):
        config = draw(config)
    m = draw(st.integers(1, max_tokens), label="m")
    x = draw(token_batches(m, config.hidden_size, dtype=dtype))
    seed = draw(st.integers(0, 2**16), label="param_seed")
    return ForwardCase(config, x, seed, bias_scale)


@checked_switches("allow_empty")
@st.composite
def partitions(draw: st.DrawFn, m: int, *, max_ranks: int = 4, max_micro_batches: int = 3,
               allow_empty: bool = True) -> Partition:
    """A `Partition` of tokens `0..m-1` over ranks and micro-batches.

    The tokens are shuffled, then cut into `ranks x micro_batches` consecutive
    blocks. Blocks may be empty (a rank with no token in some micro-batch)
    unless `allow_empty=False`, in which case fewer ranks and micro-batches
    are drawn when there are few tokens.
    """
    if allow_empty:
        ranks = draw(st.integers(1, max_ranks), label="ranks")
        micro = draw(st.integers(1, max_micro_batches), label="micro_batches")
    else:
        if m < 1:
            raise ValueError(f"partitions: allow_empty=False needs m >= 1 tokens, got m={m}")
        ranks = draw(st.integers(1, min(max_ranks, m)), label="ranks")
        micro = draw(st.integers(1, min(max_micro_batches, m // ranks)), label="micro_batches")
    slots = ranks * micro
    order = np.array(draw(st.permutations(range(m)), label="token order"), dtype=np.int64)
    if slots == 1:
        cuts: list[int] = []
    elif allow_empty:
        cuts = sorted(draw(st.lists(st.integers(0, m), min_size=slots - 1, max_size=slots - 1), label="cuts"))
    else:
        cuts = sorted(draw(st.lists(st.integers(1, m - 1), min_size=slots - 1, max_size=slots - 1,
                                    unique=True), label="cuts"))
    bounds = [0, *cuts, m]
    pieces = [order[bounds[t]:bounds[t + 1]] for t in range(slots)]
    blocks = tuple(tuple(pieces[r * micro:(r + 1) * micro]) for r in range(ranks))
    return Partition(blocks)


@st.composite
def batch_sequences(draw: st.DrawFn, n: int, *, steps: int = 3, min_tokens: int = 1, max_tokens: int = 8,
                    dtype: Any = np.float64) -> tuple[np.ndarray, ...]:
    """A stream of `steps` batches of sigmoid scores `[m_t, n]`, each built from a seed.

    The logits are normal, so near-ties have probability close to zero.
    """
    out = []
    for t in range(steps):
        m = draw(st.integers(min_tokens, max(min_tokens, max_tokens)), label=f"m[{t}]")
        seed = draw(st.integers(0, 2**16), label=f"seed[{t}]")
        # The step number joins the random seed, so shrunk seeds (all zero) still give different batches.
        logits = np.random.default_rng([seed, t]).normal(size=(m, n))
        out.append((1.0 / (1.0 + np.exp(-logits))).astype(dtype))
    return tuple(out)


@st.composite
def balancer_cases(draw: st.DrawFn, *, max_experts: int = 8, steps: int = 3, max_tokens: int = 8,
                   dtype: Any = np.float64) -> BalancerCase:
    """A `BalancerCase`: `steps` batches over the same experts, `top_k < n`, a centred nonzero initial bias.

    Every batch has at least `min_tokens_for_update(n, k)` tokens, so Eq. (14)
    is defined on each.
    """
    n = draw(st.integers(2, max_experts), label="n")
    k = draw(st.integers(1, n - 1), label="k")
    low = min_tokens_for_update(n, k)
    batches = draw(batch_sequences(n, steps=steps, min_tokens=low, max_tokens=max(low, max_tokens), dtype=dtype))
    # Multiples of 1/8 in [-1/2, 1/2], centred as Eq. (14) keeps a bias, and never all equal: as large as the
    # spread of the sigmoid scores, so a balancer that ignores or negates its initial bias routes other experts.
    eighths = np.array(draw(st.lists(st.integers(-4, 4), min_size=n, max_size=n), label="initial bias eighths"))
    if np.all(eighths == eighths[0]):
        eighths[0], eighths[-1] = 2, -2
    initial = eighths / 8.0 - eighths.mean() / 8.0
    return BalancerCase(batches, k, initial.astype(dtype))
