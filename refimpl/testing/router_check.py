r"""Eq. (13), checked: a user's router against the reference and the invariants of selection.

`check_router` is a list of named invariants, each a function of its own below: a report names the one that
broke, and a reader can read that one alone. Two kinds of router are checked:

* **K3's Eq. (13)** (`model_type=None`): `fn(scores, bias, top_k)`, the top-$k$ of $s + b$ with weights from
  the raw $s$, renormalized and scaled as the keywords say;
* **a transformers family's router** (`model_type="qwen3_moe"`, `"mixtral"`, `"deepseek_v3"`, ...):
  `fn(logits, bias, text_config)`, from the router's logits $z = x W_r^\top$, with that family's score
  function, its groups, its selection bias or none, and its rule for renormalizing (DeepSeek-V3 renormalizes
  a single chosen weight when `norm_topk_prob`; Mixtral always; Qwen3-MoE when `norm_topk_prob`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
from hypothesis import settings as Settings
from hypothesis import strategies as st

from .._lib.validation import check_float_dtype, check_int, check_positive
from .._lib.values import is_real, switch_value
from .._lib.xp import dtype_name
from ..config import MoEConfig
from ..families import family_of
from ..layer.routing import route, score_function_values
from . import strategies as rst
from .hf_cases import ROUTING_RESOLUTION, hf_family_text_configs
from .outputs import error_line, fmt, route_output, sorted_route, token_lines, within
from .profiles import kit_settings
from .report import CheckResult, Invariant, Violation, call_user, run_check

__all__ = ["FamilyRouterCase", "check_router", "dtype_tolerances", "family_router_cases", "tolerance_value"]

#: The numbers of experts of the longer rows on which the declared tie order is also tried: more than the 16
#: values that a sort may order by insertion (libstdc++'s `std::sort`, and NumPy's `np.argsort` where NumPy has
#: no vectorized sort for the CPU), which keeps equal values in id order.
LONG_ROWS = (17, 32)


# ---------------------------------------------------------------------------
# What is checked: the user's router and the rules it is held to
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _Router:
    """The user's router and what it declared (K3's Eq. 13), or the family it claims (`model_type`)."""

    fn: Callable[..., Any]
    renormalize: bool = True
    scaling_factor: float = 1.0
    dtype: Any = np.float32
    rtol: float = 1e-5
    atol: float = 1e-6
    model_type: str | None = None


@dataclass(frozen=True, eq=False)
class FamilyRouterCase:
    """One input of a family's router: its config keys, logits `[m, n]` (float32) and a bias `[n]` or None.

    `text_config` holds the family's keys with `hidden_size` equal to the number of experts, so that a router
    module built from it and given an identity gate weight turns these logits, fed as hidden states, into
    its own logits unchanged. `config` is what the family's class reads from the keys.
    """

    text_config: dict[str, Any]
    logits: np.ndarray  # [m, n], float32
    bias: np.ndarray | None  # [n], float32, or None for a router without a selection bias
    config: MoEConfig = field(repr=False)

    @property
    def m(self) -> int:
        return int(self.logits.shape[0])

    @property
    def n(self) -> int:
        return int(self.logits.shape[1])

    @property
    def top_k(self) -> int:
        return self.config.top_k

    @property
    def scores(self) -> np.ndarray:
        """The scores in float64 from the float32 logits the router receives, `[m, n]`."""
        return np.asarray(score_function_values(self.logits.astype(np.float64), self.config.score_function))

    @property
    def bias64(self) -> np.ndarray:
        return np.zeros(self.n) if self.bias is None else self.bias.astype(np.float64)

    @property
    def biased(self) -> np.ndarray:
        return self.scores + self.bias64

    def allowed_groups(self) -> tuple[np.ndarray, np.ndarray]:
        """Each token's experts in its `topk_group` best groups `[m, n]`, and whether that choice is clear `[m]`.

        A group scores the sum of its two best biased scores; a token whose last kept and first dropped group
        scores are closer than the kit's routing resolution has no clear choice of groups.
        """
        c, biased = self.config, self.biased
        if c.n_group == 1 or c.topk_group >= c.n_group:
            return np.ones(biased.shape, dtype=bool), np.ones(self.m, dtype=bool)
        grouped = biased.reshape(self.m, c.n_group, self.n // c.n_group)  # [m, G, n/G]
        group_score = -np.sort(-grouped, axis=2)[:, :, :2].sum(axis=2)  # [m, G]
        ordered = -np.sort(-group_score, axis=1)
        clear = ordered[:, c.topk_group - 1] - ordered[:, c.topk_group] >= ROUTING_RESOLUTION
        kept = np.argsort(-group_score, axis=1, kind="stable")[:, : c.topk_group]
        allowed = np.zeros((self.m, c.n_group), dtype=bool)
        np.put_along_axis(allowed, kept, True, axis=1)
        return np.repeat(allowed, self.n // c.n_group, axis=1), clear

    def reference(self) -> tuple[np.ndarray, np.ndarray]:
        """The family's route in float64: `route` with its groups, renormalization and scale."""
        c = self.config
        return route(self.scores, self.bias64, c.top_k, renormalize=c.renormalize,
                     scaling_factor=c.routed_scaling_factor, n_group=c.n_group, topk_group=c.topk_group)


def _logits_for(scores: np.ndarray, score_function: str) -> np.ndarray:
    """Logits whose scores are `scores` (up to a per-token factor, for softmax), in float64."""
    if score_function == "sigmoid":
        return np.log(scores / (1 - scores))
    if score_function == "softmax":
        return np.log(scores)  # softmax(log s) = s / sum(s): the same order, gaps shrunk by at most n
    return np.log(np.expm1(scores * scores))  # sqrt(softplus(z)) = s


@st.composite
def family_router_cases(draw: st.DrawFn, model_type: str, *, max_tokens: int = 8, max_experts: int = 8,
                        ties: bool = False) -> FamilyRouterCase:
    r"""`FamilyRouterCase`s of `model_type`: its keys (groups where it has them), logits and its bias or none.

    Without `ties`, the scores are the shuffled grid of `strategies.routing_cases` and the bias has a
    fractional part of its own per expert, so no two biased scores of a token are within float32's reach;
    the bias sits far from zero in some cases, as trained biases do. With `ties`, logits and bias lie on a
    coarse grid, so exact ties are common.
    """
    family = family_of(model_type)
    text = draw(hf_family_text_configs(model_type, max_experts=max_experts), label="text_config")
    n = text[family.keys["num_experts"].key]
    text["hidden_size"] = n  # an identity gate weight turns logits fed as hidden states into the same logits
    text.pop("moe_latent_size", None)  # the latent path is not the router's
    config = MoEConfig.from_hf_config(text, code="transformers")
    m = draw(st.integers(1, max_tokens), label="tokens")
    if ties:
        logits = np.array(draw(st.lists(st.sampled_from([-1.0, -0.5, 0.0, 0.5, 1.0]), min_size=m * n,
                                        max_size=m * n), label="logits")).reshape(m, n)
        bias = np.array(draw(st.lists(st.sampled_from([0.0, 0.125]), min_size=n, max_size=n), label="bias"))
    else:
        N = m * n
        pi = np.array(draw(st.permutations(range(N)), label="score ranks"), dtype=np.float64).reshape(m, n)
        scores = (pi + 1.0) / (N + 1.0)  # [m, n], distinct
        logits = _logits_for(scores, config.score_function)
        whole = np.array(draw(st.lists(st.integers(-N, N), min_size=n, max_size=n), label="bias integers"))
        tau = np.array(draw(st.permutations(range(1, n + 1)), label="bias fractions"), dtype=np.float64)
        offset = draw(st.sampled_from([0.0, 3.0, -20.0]), label="bias offset")
        bias = (whole + tau / (n + 1)) / (N + 1) + offset  # [n]: every expert's own fractional part
    return FamilyRouterCase(text, logits.astype(np.float32), bias.astype(np.float32) if family.has_bias else None,
                            config)


# ---------------------------------------------------------------------------
# Calling the router
# ---------------------------------------------------------------------------

def _run(router: _Router, case: Any, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The user's `(index, weights)` on `case` (with `bias` in place of the case's), validated."""
    if router.model_type is not None:
        b = case.bias if bias is None else bias
        out = call_user(router.fn, case.logits, None if b is None else b.astype(np.float32), dict(case.text_config))
        return route_output(out, case.m, case.n, case.top_k)
    b = case.bias if bias is None else bias
    out = call_user(router.fn, case.scores.astype(router.dtype), b.astype(router.dtype), case.top_k)
    return route_output(out, case.m, case.n, case.top_k)


def _inputs(router: _Router, case: Any, **extra: Any) -> dict[str, Any]:
    if router.model_type is not None:
        return {"logits": case.logits, "bias": case.bias, "text_config": case.text_config, **extra}
    return {"scores": case.scores.astype(router.dtype), "bias": case.bias.astype(router.dtype),
            "top_k": case.top_k, **extra}


def _scores(router: _Router, case: Any) -> np.ndarray:
    """The raw scores `[m, n]` the weights come from, in float64."""
    if router.model_type is not None:
        return case.scores
    return case.scores.astype(router.dtype).astype(np.float64)


def _biased(router: _Router, case: Any) -> np.ndarray:
    """The selection scores $s + b$ `[m, n]`, in float64, from the values the router received."""
    if router.model_type is not None:
        return case.biased
    return case.scores.astype(router.dtype).astype(np.float64) + case.bias.astype(router.dtype).astype(np.float64)


def _rule(router: _Router, case: Any) -> tuple[bool, float]:
    """(renormalize, scaling factor) the router is held to: the declared ones, or the family's reading."""
    if router.model_type is not None:
        return case.config.renormalize, case.config.routed_scaling_factor
    return router.renormalize, router.scaling_factor


# ---------------------------------------------------------------------------
# The invariants, one function each
# ---------------------------------------------------------------------------

def output_form(router: _Router, case: Any) -> None:
    """index [m, k] integer ids in [0, n), weights [m, k] finite floats."""
    _run(router, case)


def distinct_ids(router: _Router, case: Any) -> None:
    """Eq. (13): T_i is a set of k different experts."""
    index, _ = _run(router, case)
    repeated = np.flatnonzero(np.any(np.diff(np.sort(index, axis=1), axis=1) == 0, axis=1))
    if repeated.size:
        raise Violation(f"{repeated.size} of {case.m} tokens list the same expert more than once",
                        token_lines(repeated, lambda i: f"token {i}: experts {index[i].tolist()}"),
                        _inputs(router, case))


def raw_weights(router: _Router, case: Any) -> None:
    r"""Eq. (13): $p_{i,j} = c\, s_{i,j} / \sum_{r \in T_i} s_{i,r}$ over the router's own choice $T_i$."""
    index, weights = _run(router, case)
    renormalize, scale = _rule(router, case)
    raw = np.take_along_axis(_scores(router, case), index, axis=1)  # [m, k]
    expected = (raw / raw.sum(axis=1, keepdims=True) if renormalize else raw) * scale
    bad = np.flatnonzero(~np.all(within(weights, expected, router.rtol, router.atol), axis=1))
    if not bad.size:
        return
    sb = np.take_along_axis(_biased(router, case), index, axis=1)
    from_biased = (sb / sb.sum(axis=1, keepdims=True) if renormalize else sb) * scale
    details = token_lines(bad, lambda i: (f"token {i}: experts {index[i].tolist()}, raw scores {fmt(raw[i])}, "
                                          f"expected weights {fmt(expected[i])}, got {fmt(weights[i])}"))
    details.append(error_line(weights, expected, router.rtol, router.atol))
    if np.allclose(weights, from_biased, rtol=max(router.rtol, 1e-5), atol=max(router.atol, 1e-6)):
        details.append("the weights returned are those of the BIASED scores s + b: the bias must choose the "
                       "experts, never weigh them")
    if case.top_k == 1 and router.model_type is not None:
        details.append(f"with top_k = 1 {router.model_type} {'renormalizes' if renormalize else 'keeps'} the single "
                       f"weight ({'so it is the scaling factor' if renormalize else 'the raw score'}): K3's code "
                       "keeps it raw, DeepSeek-V3's renormalizes it when norm_topk_prob")
    raise Violation(f"{bad.size} of {case.m} tokens have weights that are not their raw scores"
                    + (" renormalized" if renormalize else "") + f" times {scale:g}", details, _inputs(router, case))


def weight_sums(router: _Router, case: Any) -> None:
    """Eq. (13): the k weights are renormalized to sum to one, then scaled by the routed scaling factor."""
    _, weights = _run(router, case)
    _, scale = _rule(router, case)
    total = weights.sum(axis=1)  # [m]
    bad = np.flatnonzero(~within(total, np.full_like(total, scale), router.rtol, router.atol))
    if bad.size:
        raise Violation(f"{bad.size} of {case.m} tokens have weights that do not sum to the scaling factor {scale:g}",
                        token_lines(bad, lambda i: f"token {i}: weights {fmt(weights[i])} sum to {total[i]:.8g}"),
                        _inputs(router, case))


def shift_invariance(router: _Router, drawn: tuple[Any, float]) -> None:
    r"""Eq. (13)-(14): $\operatorname{argtopk}_k(s_i + b + c) = \operatorname{argtopk}_k(s_i + b)$."""
    case, c = drawn
    if router.model_type is None and np.dtype(router.dtype).itemsize < 4:
        _shifted_half(router, case, c)
        return
    bias = case.bias.astype(np.float64) + c
    ids, w = sorted_route(*_run(router, case))
    ids_c, w_c = sorted_route(*_run(router, case, bias if router.model_type else bias.astype(router.dtype)))
    moved = np.flatnonzero(np.any(ids != ids_c, axis=1))
    if moved.size:
        raise Violation(
            f"adding c = {c:g} to every bias changed the experts of {moved.size} of {case.m} tokens "
            "(a common shift of b changes no top-k)",
            token_lines(moved, lambda i: f"token {i}: with b {ids[i].tolist()}, with b + c {ids_c[i].tolist()}")
            + ["a bias held or added in low precision loses its small differences when it sits far from zero: "
               "keep b and s + b in float32 or wider"],
            _inputs(router, case, shift_c=c))
    bad = np.flatnonzero(~np.all(within(w_c, w, router.rtol, router.atol), axis=1))
    if bad.size:
        raise Violation(f"adding c = {c:g} to every bias changed the weights of {bad.size} of {case.m} tokens "
                        "(the bias must not enter the weights)",
                        token_lines(bad, lambda i: f"token {i}: weights with b {fmt(w[i])}, with b + c {fmt(w_c[i])}")
                        + [error_line(w_c, w, router.rtol, router.atol)], _inputs(router, case, shift_c=c))


def _shifted_half(router: _Router, case: Any, c: float) -> None:
    r"""Bias-shift invariance in a half dtype: the shifted call judged against the bias it actually received.

    In float16 or bfloat16, $b + c$ is itself rounded when it is handed over: far from zero nearby biases
    merge, and the route of the rounded bias is another route. So the router's answer to the shifted bias is
    held to the reference's answer on that rounded bias: a valid top-$k$ of $s + \operatorname{round}(b + c)$
    (ties among merged biases go either way), weighted by the raw scores of the experts it chose.
    """
    received = (case.bias.astype(router.dtype).astype(np.float64) + c).astype(router.dtype)  # [n]
    index, weights = _run(router, case, received)
    sb = _scores(router, case) + received.astype(np.float64)  # [m, n], as the router received them
    chosen = np.zeros(sb.shape, dtype=bool)
    np.put_along_axis(chosen, index, True, axis=1)
    low = np.where(chosen, sb, np.inf).min(axis=1)
    high = np.where(chosen, -np.inf, sb).max(axis=1)
    inputs = _inputs(router, case, shift_c=c)
    bad = np.flatnonzero(low < high)
    if bad.size:
        raise Violation(f"with every bias shifted by c = {c:g} ({dtype_name(np.dtype(router.dtype))}, as handed "
                        f"over), {bad.size} of {case.m} tokens chose an expert whose s + b + c is below an "
                        "unchosen one", token_lines(bad, lambda i: f"token {i}: chose {np.sort(index[i]).tolist()}, "
                                                                   f"s + b + c = {fmt(sb[i])}"), inputs)
    renormalize, scale = _rule(router, case)
    raw = np.take_along_axis(_scores(router, case), index, axis=1)  # [m, k]
    expected = (raw / raw.sum(axis=1, keepdims=True) if renormalize else raw) * scale
    bad = np.flatnonzero(~np.all(within(weights, expected, router.rtol, router.atol), axis=1))
    if bad.size:
        raise Violation(f"with every bias shifted by c = {c:g}, {bad.size} of {case.m} tokens have weights that "
                        "are not their raw scores" + (" renormalized" if renormalize else "") + f" times {scale:g} "
                        "(the bias must not enter the weights)",
                        token_lines(bad, lambda i: f"token {i}: expected weights {fmt(expected[i])}, got "
                                                   f"{fmt(weights[i])}")
                        + [error_line(weights, expected, router.rtol, router.atol)], inputs)


def selection(router: _Router, case: Any) -> None:
    r"""Eq. (13): $T_i = \operatorname{argtopk}_k(s_i + b)$ (within the chosen groups, for a family with groups).

    The scores and bias the router receives are cast to its dtype, and a half dtype may round two biased
    scores of a token to the same value (bfloat16 cannot tell apart values $2^{-14}$ apart near 1/2). A token
    whose $k$-th and $(k+1)$-th received biased scores tie, to float32's resolution, is held to a valid top-$k$
    of them instead of `route`'s lower-id choice: the tie order is the business of `lower_id_ties`, declared.
    """
    ids, _ = sorted_route(*_run(router, case))
    if router.model_type is not None:
        expected = np.sort(case.reference()[0], axis=1)
        compared = case.allowed_groups()[1]
        differs = np.any(ids != expected, axis=1)
    else:
        expected = np.sort(route(_scores(router, case), case.bias.astype(router.dtype).astype(np.float64),
                                 case.top_k)[0], axis=1)
        compared = np.ones(case.m, dtype=bool)
        differs = np.any(ids != expected, axis=1)
        if case.top_k < case.n:
            sb = _biased(router, case)
            ordered = -np.sort(-sb, axis=1)
            edge = ordered[:, case.top_k - 1]
            tied = edge - ordered[:, case.top_k] <= 4 * np.finfo(np.float32).eps * np.maximum(1.0, np.abs(edge))
            chosen = np.zeros(sb.shape, dtype=bool)
            np.put_along_axis(chosen, ids, True, axis=1)
            valid = np.where(chosen, sb, np.inf).min(axis=1) >= np.where(chosen, -np.inf, sb).max(axis=1) - (
                4 * np.finfo(np.float32).eps * np.maximum(1.0, np.abs(edge)))
            differs = np.where(tied, ~valid, differs)
    wrong = np.flatnonzero(compared & differs)
    if wrong.size:
        sb = _biased(router, case)
        what = "s + b" if router.model_type is None or case.bias is not None else "s"
        raise Violation(
            f"{wrong.size} of {case.m} tokens chose other experts than the top-{case.top_k} of {what}",
            token_lines(wrong, lambda i: (f"token {i}: expected experts {expected[i].tolist()} ({what} = "
                                          f"{fmt(sb[i, expected[i]])}), got {ids[i].tolist()} "
                                          f"({what} = {fmt(sb[i, ids[i]])})")),
            _inputs(router, case))


def chosen_groups_only(router: _Router, case: FamilyRouterCase) -> None:
    """Group-limited routing: every chosen expert lies in one of the token's topk_group best groups."""
    index, _ = _run(router, case)
    allowed, clear = case.allowed_groups()
    outside = np.flatnonzero(clear & ~np.all(np.take_along_axis(allowed, index, axis=1), axis=1))
    if outside.size:
        c = case.config
        raise Violation(
            f"{outside.size} of {case.m} tokens chose an expert outside their {c.topk_group} best of {c.n_group} "
            "groups (a group scores the sum of its two best s + b)",
            token_lines(outside, lambda i: f"token {i}: chose {np.sort(index[i]).tolist()}, allowed experts "
                                           f"{np.flatnonzero(allowed[i]).tolist()}")
            + ["dropped groups must be masked with -inf: masked with 0, their experts win over negative s + b"],
            _inputs(router, case))


def valid_topk_with_ties(router: _Router, case: Any) -> None:
    r"""Eq. (13) with ties: $\min_{j \in T_i} (s_{i,j} + b_j) \ge \max_{j \notin T_i} (s_{i,j} + b_j)$."""
    index, _ = _run(router, case)
    sb = _biased(router, case)
    compared = np.ones(case.m, dtype=bool)
    if router.model_type is not None:
        allowed, compared = case.allowed_groups()
        sb = np.where(allowed, sb, -np.inf)  # a token's choice among its allowed groups' experts
    chosen = np.zeros(sb.shape, dtype=bool)
    np.put_along_axis(chosen, index, True, axis=1)
    low = np.where(chosen, sb, np.inf).min(axis=1)  # lowest chosen biased score, [m]
    high = np.where(chosen, -np.inf, sb).max(axis=1)  # highest unchosen one, [m]
    bad = np.flatnonzero(compared & (low < high))
    if bad.size:
        raise Violation(f"{bad.size} of {case.m} tokens chose an expert whose biased score is below an unchosen one",
                        token_lines(bad, lambda i: f"token {i}: chose {np.sort(index[i]).tolist()}, s + b = "
                                                   f"{fmt(sb[i])}"), _inputs(router, case))


def tied_route(router: _Router, case: Any) -> None:
    r"""Eq. (13) with ties: a valid top-$k$ of $s + b$, weighted by the raw scores of the experts it chose.

    A tie leaves the choice among the tied experts open, not the weights: they come from the raw scores of
    the $k$ experts chosen (renormalized over those $k$ and scaled), so a router that renormalizes over every
    expert at or above the $k$-th value (more than $k$ of them on a tie) fails here.
    """
    valid_topk_with_ties(router, case)
    renormalize, _ = _rule(router, case)
    checks = [raw_weights, weight_sums] if renormalize else [raw_weights]
    for check in checks:
        try:
            check(router, case)
        except Violation as v:
            v.summary = f"on an input with tied biased scores, {v.summary}"
            v.args = (v.summary,)
            raise


def lower_id_ties(router: _Router, case: Any) -> None:
    """The tie order declared: among equal biased scores the lower expert id is chosen."""
    ids, _ = sorted_route(*_run(router, case))
    expected = np.sort(route(case.scores.astype(np.float64), case.bias.astype(np.float64), case.top_k)[0], axis=1)
    wrong = np.flatnonzero(np.any(ids != expected, axis=1))
    if wrong.size:
        sb = _biased(router, case)
        raise Violation(f"{wrong.size} of {case.m} tokens broke a tie in favour of a higher expert id",
                        token_lines(wrong, lambda i: (f"token {i}: s + b = {fmt(sb[i])}, expected experts "
                                                       f"{expected[i].tolist()}, got {ids[i].tolist()}")),
                        _inputs(router, case))


# ---------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------

#: The unit roundoff of the dtypes whose default tolerances are derived from float32's.
_UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24}


def dtype_tolerances(dtype: Any, rtol: Any, atol: Any, rtol32: float, atol32: float) -> tuple[float, float]:
    r"""`(rtol, atol)` checked (`tolerance_value`), a `None` one replaced by the default for `dtype`.

    The defaults are a check's float32 ones (`rtol32`, `atol32`) scaled by the unit roundoff of `dtype` over
    float32's, as `check_hf_moe_block` scales its tolerance with $u$: float64 is held $2^{29}$ times tighter,
    so a port computing in float32 fails a float64 check. A half dtype keeps float32's defaults: scaled by
    its roundoff they would pass weights off by tenths, and a half-precision port states the tolerance it
    needs (a few 1e-2 for bfloat16).
    """
    scale = _UNIT_ROUNDOFF.get(dtype_name(np.dtype(dtype)), _UNIT_ROUNDOFF["float32"]) / _UNIT_ROUNDOFF["float32"]
    return (rtol32 * scale if rtol is None else tolerance_value("rtol", rtol),
            atol32 * scale if atol is None else tolerance_value("atol", atol))


def tolerance_value(name: str, value: Any) -> float:
    """`value` as a float if it is a finite real number >= 0 (a tolerance); else an error naming `name`.

    A negative or NaN tolerance would fail a correct router on every case, and a string would fail inside
    NumPy: both are refused before anything runs.
    """
    if not is_real(value):
        raise TypeError(f"{name} must be a real number >= 0, got {type(value).__name__} {value!r:.60}")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond float64
        number = math.inf
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return number


def check_router(fn: Callable[..., tuple[Any, Any]], *, renormalize: bool = True, scaling_factor: float = 1.0,
                 tie_order: str | None = None, dtype: Any = np.float32, rtol: float | None = None,
                 atol: float | None = None,
                 max_tokens: int = 12, max_experts: int = 10, settings: str | Settings | None = None,
                 model_type: str | None = None) -> CheckResult:
    r"""Check a router against Eq. (13), or against a transformers family's router with `model_type`.

    **K3's Eq. (13)** (`model_type=None`): `fn(scores, bias, top_k) -> (index, weights)`, `scores` `[m, n]`
    and `bias` `[n]` NumPy arrays of `dtype`; held to the top-$k$ of $s + b$, weights from the raw $s$,
    renormalized when `renormalize`, times `scaling_factor`.

    **A family's router** (`model_type="qwen3_moe"`, `"mixtral"`, `"deepseek_v3"`, `"glm4_moe"`,
    `"kimi_linear"`, `"nemotron_h"`, `"deepseek_v4"`): `fn(logits, bias, text_config) -> (index, weights)`,
    with `logits` `[m, n]` float32 (the router's $x W_r^\top$), `bias` `[n]` float32 or `None` for a family
    whose router has no selection bias (Qwen3-MoE, Mixtral), and `text_config` the family's config keys
    (groups drawn where the family has them; `hidden_size` equals $n$, so a router module built from it with
    an identity gate weight can take the logits as its hidden states). The check holds the family's rules,
    read from the keys as its configuration class reads them: its score function, its groups, its
    renormalization (DeepSeek-V3 renormalizes a single chosen weight when `norm_topk_prob`; K3's code does
    not) and its scale. `renormalize` and `scaling_factor` are then not used.

    Invariants, in the order they run (each a function of this module, named in the report):

    1. **output shape and dtype** (`output_form`): `[m, k]` integer ids in `[0, n)`, finite float weights;
    2. **distinct experts per token** (`distinct_ids`);
    3. **weights from raw scores** (`raw_weights`): $p_{i,j} = c\,s_{i,j}/\sum_{r\in T_i} s_{i,r}$ over the
       router's own choice $T_i$ (no division without renormalization);
    4. **weights sum to the scaling factor** (`weight_sums`, when renormalizing);
    5. **bias-shift invariance** (`shift_invariance`, for routers with a bias): `fn(..., bias + c, ...)` chooses
       the same experts with the same weights, for shifts $c$ up to 100;
    6. **selection is the top-k of s + b** (`selection`): the same experts as `route` (within the chosen groups);
    7. **experts only from the chosen groups** (`chosen_groups_only`, for a family with groups);
    8. **ties give a valid top-k** (`tied_route`): on inputs with exact ties, every chosen biased score is at
       least every unchosen one, and the weights are those of invariants 3 and 4 over the router's own choice
       (a tie leaves the choice open, not the weights);
    9. **tie order: lower id first** (`lower_id_ties`), only when `tie_order="lower_id"` (K3's Eq. 13), on
       rows of up to `max_experts` experts and on rows of 17 to 32 (`LONG_ROWS`) whatever `max_experts` says:
       many sorts order a row of up to 16 values by insertion, which keeps ties in id order, so an unstable
       sort (`np.argsort`'s default kind on some CPUs, `std::sort`) passes on short rows alone.

    Inputs for 3-7 have no two nearly equal biased scores in a token (see `strategies.routing_cases`; a
    family's token whose group scores nearly tie is not compared for its groups), so any correct float32 router
    agrees (in a half dtype the cast itself may tie two of them exactly: such a token is held to a valid top-$k$,
    the choice among the tied experts left open). `rtol` and `atol` apply to the weights (finite, at least 0;
    by default 1e-5 and 1e-6, and $2^{-29}$ times those for float64, see `dtype_tolerances`, so a router that
    computes in float32 fails a float64 check). `settings` is a profile name or a
    `hypothesis.settings`. `dtype` is float32 (default), float64, float16 or bfloat16; in a half dtype the
    shifted bias $b + c$ is itself rounded when it is handed over, so invariant 5 holds the shifted call to the
    reference on the bias it received (a valid top-$k$ of $s + \operatorname{round}(b + c)$, weights from its raw
    scores) rather than to the unshifted call. Bad arguments are a `TypeError` or `ValueError` naming them.
    """
    if not callable(fn):
        raise TypeError(f"fn must be the router, a function, got {type(fn).__name__} {fn!r:.60}")
    renormalize = switch_value(renormalize, "renormalize")
    scaling_factor = check_positive("scaling_factor", scaling_factor)
    dtype = check_float_dtype(dtype, "dtype")
    rtol, atol = dtype_tolerances(dtype if model_type is None else np.float32, rtol, atol, 1e-5, 1e-6)
    max_tokens = check_int("max_tokens", max_tokens, low=1)
    max_experts = check_int("max_experts", max_experts, low=2)  # a choice needs two experts to choose from
    resolved = kit_settings(settings)  # a bad profile name is an error before anything runs
    if tie_order not in (None, "lower_id"):
        raise ValueError(f"tie_order must be None or 'lower_id', got {tie_order!r}")
    if model_type is not None:
        family = family_of(model_type)  # an unknown family is an error before anything runs
        if tie_order is not None:
            raise ValueError(f"tie_order is declared for K3's Eq. (13) only, not with model_type={model_type!r}")
        router = _Router(fn, rtol=rtol, atol=atol, model_type=model_type)
        distinct = family_router_cases(model_type, max_tokens=max_tokens, max_experts=min(max_experts, 8))
        tied = family_router_cases(model_type, max_tokens=max_tokens, max_experts=min(max_experts, 8), ties=True)
        has_bias, grouped = family.has_bias, "n_group" in family.keys
        renormalizes = True  # the family's own rule decides per case; the sum invariant skips cases without it
    else:
        router = _Router(fn, renormalize, scaling_factor, dtype, rtol, atol)
        sizes = dict(max_tokens=max_tokens, max_experts=max_experts)
        distinct = rst.routing_cases(distinct=True, **sizes)
        tied = rst.routing_cases(ties=True, **sizes)
        has_bias, grouped, renormalizes = True, False, renormalize

    def named(name: str, strategy: st.SearchStrategy, body: Callable[..., None], *, basic: bool = False,
              shifted: bool = False) -> Invariant:
        why = (body.__doc__ or "").strip().split("\n")[0]
        describe = ((lambda drawn: _inputs(router, drawn[0], shift_c=drawn[1])) if shifted
                    else partial(_inputs, router))
        return Invariant(name, why, strategy, partial(body, router), basic=basic, describe=describe)

    invariants = [
        named("output shape and dtype", distinct, output_form, basic=True),
        named("distinct experts per token", distinct, distinct_ids, basic=True),
        named("weights from raw scores", distinct, raw_weights),
    ]
    if renormalizes:
        sums = distinct if model_type is None else distinct.filter(lambda case: case.config.renormalize)
        invariants.append(named("weights sum to the scaling factor", sums, weight_sums))
    if has_bias:
        invariants.append(named("bias-shift invariance", st.tuples(distinct, rst.bias_shifts()), shift_invariance,
                                shifted=True))
    invariants.append(named("selection is the top-k of s + b" if has_bias else "selection is the top-k of s",
                            distinct, selection))
    if grouped:
        with_groups = distinct.filter(lambda case: case.config.topk_group < case.config.n_group)
        invariants.append(named("experts only from the chosen groups", with_groups, chosen_groups_only))
    invariants.append(named("ties give a valid top-k", tied, tied_route))
    if tie_order == "lower_id":
        # An unstable sort shows itself on rows longer than those a sort may order by insertion (`LONG_ROWS`).
        longer = rst.routing_cases(ties=True, max_tokens=max_tokens, min_experts=LONG_ROWS[0],
                                   max_experts=max(LONG_ROWS[1], max_experts))
        invariants.append(named("tie order: lower id first", st.one_of(tied, longer), lower_id_ties))
    return run_check("check_router", invariants, resolved)

