r"""The catalogue of convention differences: known ways a port of the K3 block computes something else.

Every entry is a mistake that real ports have made, or a reading of the
configuration that differs from the reference modeling code's, written as a
**variant of the reference**: the same block on the same weights and tokens
with one convention changed. `check_hf_moe_block` runs every variant that
applies to a failing case and names those whose output matches the port's to
the check's tolerance, so a failure says *which* convention the port got
wrong, not only that its numbers differ.

| entry | what the port does | where it shipped |
|---|---|---|
| `bias_in_weights` | mixture weights from the biased scores $s + b$ | vLLM #12002; transformers #41647 |
| `scale_applied_twice` | `routed_scaling_factor` multiplied in twice | vLLM #24119; kvcache-ai/sglang #86 |
| `scale_skipped_without_renormalization` | the factor dropped on the path that does not renormalize | sglang-jax #1282 |
| `scale_never_applied` | the factor never applied | |
| `top1_renormalized` | with `top_k = 1` the single weight renormalized to 1 (K3's code keeps it raw) | |
| `top1_kept_raw` | with `top_k = 1` the single weight kept raw in a model that renormalizes it (DeepSeek-V3, GLM-4 MoE, Kimi Linear in transformers) | |
| `renormalization_flipped` | the renormalization switch (`moe_renormalize`, `norm_topk_prob`) read the other way | |
| `groups_by_max` | a group scored by its best expert, not the sum of its two best | vLLM #13474, #46869 |
| `groups_masked_with_zero` | the experts of dropped groups masked with 0, not $-\infty$: with negative biased scores they are chosen | |
| `bias_subtracted` | selection by $s - b$ | |
| `bias_in_bfloat16` | the selection bias kept in bfloat16: far from zero, nearby experts' biases merge | |
| `bias_ignored` | selection by $s$ alone | |
| `bias_on_logits` | selection by the raw logits plus the bias, $z + b$, not the scores (the weights still from the scores) | Megatron-Core's Quantile Balancing router |
| `score_function_flipped` | sigmoid for softmax, or softmax for sigmoid | |
| `bf16_router` | router logits computed in bfloat16 instead of float32 | SGLang PR #33764 |
| `router_in_bfloat16` | the whole router in bfloat16: logits, scores, $s + b$, the selection and the weights, each rounded | MaxText's default router dtype |
| `up_cap_flipped` | the up branch capped (at K3's 25) when the key is absent, or left uncapped when it is set | |
| `gate_cap_k3_default` | an absent `activation_situ_beta` read as K3's 4.0 instead of the reference's 1.0 | |
| `silu_for_situ` | SiLU (SwiGLU) in place of SiTU | Megatron-LM discussion #6673 |
| `latent_norm_dropped` | the latent RMSNorm skipped | a Megatron-LM fork, #94 |
| `norm_after_up_projection` | the latent RMSNorm applied to $u W_\uparrow^\top$ instead of $u$ (possible when $\ell = d$) | |
| `norm_eps_other` | the latent norm's $\varepsilon$ 1e-5 where the config says 1e-6, or the reverse | |
| `experts_summed_in_bfloat16` | the weighted expert outputs added into a bfloat16 buffer, expert by expert | |
| `gate_up_swapped` | `w1` read as the up and `w3` as the gate projection | |
| `weight_on_expert_input` | the routing weight applied to the expert's input, $E(p\,x)$, not its output (Llama 4's convention) | |
| `absent_keys_as_k3` | a family's absent keys read with K3's code's meaning instead of its configuration class's defaults | |
| `shared_experts_dropped` | the shared experts left out | |
| `mxfp4_nibbles_swapped` | the high nibble read as the even column | |
| `e8m0_bias_125` | E8M0 scales read as $2^{s-125}$ instead of $2^{s-127}$ | compressed-tensors #538 |
| `e8m0_as_e4m3` | E8M0 scale bytes read as E4M3 numbers | b12x #116 |

An empty last column means no public report is catalogued here; the
difference is still one a port can make, usually by reading a config key
with another model's meaning.

Two mistakes from the same trackers are caught before any output is
compared, so they have no entry: a latent norm sized by `hidden_size`
instead of $\ell$ (SGLang #37704) is a tensor of the wrong shape, which
`params_from_hf_state_dict` and PyTorch's `load_state_dict(strict=True)` both
refuse; and the $\sqrt{\operatorname{softplus}}$ underflow and the 0/0 of hash
routing (SGLang #34459) belong to DeepSeek-V4's router, which the reference K3
block does not have (refimpl's own versions are on the page of the other
routers).

Each entry holds a name, a one-line summary, the issue where it shipped, a
predicate saying whether it can matter on a case (a scaling factor of 1
cannot be applied twice visibly), and a function computing the variant's
output on a case with the public pieces of this package: `stable_latent_moe`
with a changed `MoEConfig`, changed parameters, or a route computed another
way and passed as `routing=(index, weights)`.

## Assuming a difference

Most entries are a change of the configuration or of the weights the layer
is computed with (`Convention.change`). Such an entry can be **assumed**:
`assume(case, ["gate_up_swapped"])` is the same case with the layer
computed as a block that has the difference computes it, so its
`expected()` is that block's output, and every entry run on it gives the
output of a block with both differences. `check_hf_moe_block` uses this to
look for a second difference in a port whose first one changes every
output. The entries that compute a route or an output another way (the
weights from $s + b$, the group rules, the bfloat16 routers and sums, the
norm after the up-projection, the weight on the expert's input, the MXFP4
decodings) are not changes of the config or weights and cannot be assumed:
the check leaves out the cases on which they show instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import ml_dtypes
import numpy as np

from ..config import MoEConfig
from ..layer.activations import rms_norm
from ..layer.latent_moe import MoEParams, latent_output, routed_experts, stable_latent_moe
from ..layer.routing import biased_scores, route, router_scores, score_function_values
from ..mx import mxfp4_decode
from .hf_cases import HFBlockCase, keys_family, kit_family

__all__ = ["CATALOGUE", "Convention", "assume", "convention"]

#: A difference as a change of what the layer is computed with: the case (with the differences assumed before
#: it) to the config and float64 weights of a block that also has this one.
Change = Callable[[HFBlockCase], tuple[MoEConfig, MoEParams]]


@dataclass(frozen=True)
class Convention:
    """One catalogued convention difference: what it is, where it shipped, how to compute it.

    `applies(case)` says whether the difference can change the output of
    `case` (a `refimpl.testing.HFBlockCase`); `output(case)` is the variant's
    `y` `[m, d]`, float64, on the case's weights and tokens. `change`, for an
    entry that is a change of the config or the weights (None for the others),
    makes that change: such an entry can be assumed (`assume`).
    """

    name: str
    summary: str
    issue: str | None
    applies: Callable[[HFBlockCase], bool]
    output: Callable[[HFBlockCase], np.ndarray]
    #: For a mistake whose output depends on how the port breaks ties (experts masked with one value tie with
    #: each other): every output a tie order can give, `[c, m, d]`; a block matches when each token matches one.
    resolutions: Callable[[HFBlockCase], np.ndarray] | None = None
    change: Change | None = None

    @property
    def composable(self) -> bool:
        """Whether the difference can be assumed (`assume`): a change of the config or the weights."""
        return self.change is not None

    def describe(self) -> str:
        """`name: summary (issue)`, one line for a report."""
        where = f" ({self.issue})" if self.issue else ""
        return f"{self.name}: {self.summary}{where}"


# ---------------------------------------------------------------------------
# The pieces every variant is made of
# ---------------------------------------------------------------------------

def _run(case: HFBlockCase, *, config: Any = None, params: dict[str, Any] | None = None,
         routing: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """The layer on the case's float64 tokens, with the config, parameters or route replaced."""
    return np.asarray(stable_latent_moe(case.x64, params if params is not None else case.params64,
                                        config if config is not None else case.config, routing=routing))


def _scores(case: HFBlockCase) -> np.ndarray:
    """The router scores in float64, `[m, n]`."""
    return np.asarray(router_scores(case.x64, case.params64["gate.weight"], case.config.score_function))


def _route(case: HFBlockCase, scores: np.ndarray, bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eq. (13) with the case's top-k, renormalization, scale and groups, on the given scores and bias."""
    c = case.config
    return route(scores, bias, c.top_k, renormalize=c.renormalize, scaling_factor=c.routed_scaling_factor,
                 n_group=c.n_group, topk_group=c.topk_group)


def _bias(case: HFBlockCase) -> np.ndarray:
    return case.params64["gate.e_score_correction_bias"]


def _weights(case: HFBlockCase, raw: np.ndarray) -> np.ndarray:
    r"""The gathered scores `raw` `[m, k]` made into weights: renormalized if the config says so, then scaled."""
    c = case.config
    if c.renormalize:
        # $$p_{i,j} = s_{i,j} / \textstyle\sum_{r \in T_i} s_{i,r}$$
        raw = raw / raw.sum(axis=1, keepdims=True)
    return raw * c.routed_scaling_factor


def _with(case: HFBlockCase, **changes: np.ndarray) -> MoEParams:
    """The case's float64 parameters with some entries replaced."""
    params = MoEParams(case.params64)
    params.update(changes)
    return params


def _situ(case: HFBlockCase) -> bool:
    return case.config.activation == "situ"


# ---------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------

def _bias_in_weights(case: HFBlockCase) -> np.ndarray:
    s = _scores(case)
    index, _ = _route(case, s, _bias(case))
    # The mistake: $$p_{i,j} \propto s_{i,j} + b_j$$ instead of $s_{i,j}$
    biased = np.take_along_axis(np.asarray(biased_scores(s, _bias(case))), index, axis=1)  # [m, k]
    return _run(case, routing=(index, _weights(case, biased)))


def _scale_applied_twice(case: HFBlockCase) -> tuple[MoEConfig, MoEParams]:
    c = case.config
    return c.replace(routed_scaling_factor=c.routed_scaling_factor ** 2), case.params64


def _scale_never_applied(case: HFBlockCase) -> tuple[MoEConfig, MoEParams]:
    return case.config.replace(routed_scaling_factor=1.0), case.params64


def _top1_renormalized(case: HFBlockCase) -> tuple[MoEConfig, MoEParams]:
    return case.config.replace(renormalize=True), case.params64


def _renormalization_flipped(case: HFBlockCase) -> tuple[MoEConfig, MoEParams]:
    return case.config.replace(renormalize=not case.config.renormalize), case.params64


def _kept_groups(case: HFBlockCase, group_score: Callable[[np.ndarray], np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scores s `[m, n]`, biased scores s + b `[m, n]`, `[m, n]` True for the experts of each token's kept
    groups), the best `topk_group` groups by `group_score(grouped)` of the `[m, G, n/G]` biased scores."""
    c = case.config
    s = _scores(case)
    biased = np.asarray(biased_scores(s, _bias(case)))  # [m, n]
    m, n = biased.shape
    grouped = biased.reshape(m, c.n_group, n // c.n_group)  # [m, G, n/G]
    best = np.argsort(-group_score(grouped), axis=1, kind="stable")[:, : c.topk_group]  # [m, topk_group]
    keep = np.zeros((m, c.n_group), dtype=bool)
    np.put_along_axis(keep, best, True, axis=1)
    return s, biased, np.repeat(keep, n // c.n_group, axis=1)


def _two_best(grouped: np.ndarray) -> np.ndarray:
    """The reference's group score: the sum of a group's two best biased scores, `[m, G]`."""
    return -np.sort(-grouped, axis=2)[:, :, :2].sum(axis=2)


def _top_k_of(case: HFBlockCase, s: np.ndarray, masked: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The route of the masked selection scores: top-k, ties to the lower id, weighed by the raw s."""
    index = np.argsort(-masked, axis=1, kind="stable")[:, : case.config.top_k]  # [m, k]
    return index, _weights(case, np.take_along_axis(s, index, axis=1))


def _groups_by_max(case: HFBlockCase) -> np.ndarray:
    # The mistake: a group's score is its best expert, $$\max_{j \in g}(s_j + b_j)$$, not the sum of its two best.
    s, biased, kept = _kept_groups(case, lambda grouped: grouped.max(axis=2))
    return _run(case, routing=_top_k_of(case, s, np.where(kept, biased, -np.inf)))


def _groups_masked_with_zero(case: HFBlockCase) -> np.ndarray:
    s, biased, kept = _kept_groups(case, _two_best)
    # The mistake: the experts of dropped groups get 0, not $-\infty$: below a negative biased score, they win.
    return _run(case, routing=_top_k_of(case, s, np.where(kept, biased, 0.0)))


def _groups_masked_with_zero_resolutions(case: HFBlockCase) -> np.ndarray:
    """Every output of the 0-masking mistake, one per way of choosing among the tied masked experts, `[c, m, d]`.

    An expert of a dropped group scores exactly 0, so when fewer than $k$ kept experts score above 0, the
    port's top-k picks the rest among equal zeros in an order of its own (PyTorch's is not the lowest id).
    Resolution $c$ gives each token its $c$-th possible choice (the last one, for tokens with fewer).
    """
    c = case.config
    s, biased, kept = _kept_groups(case, _two_best)
    m, n = biased.shape
    choices: list[list[np.ndarray]] = []
    for i in range(m):
        ranked = np.argsort(-biased[i], kind="stable")
        above = [j for j in ranked if kept[i, j] and biased[i, j] > 0][: c.top_k]
        zeros = [j for j in range(n) if not kept[i, j]]
        below = [j for j in ranked if kept[i, j] and biased[i, j] <= 0]
        need = c.top_k - len(above)
        if need <= 0:
            choices.append([np.array(above)])
        elif need >= len(zeros):
            choices.append([np.array(above + zeros + below[: need - len(zeros)])])
        else:
            choices.append([np.array(above + list(pick)) for pick in itertools.combinations(zeros, need)])
    outputs = []
    for r in range(max(len(options) for options in choices)):
        index = np.stack([options[min(r, len(options) - 1)] for options in choices])  # [m, k]
        outputs.append(_run(case, routing=(index, _weights(case, np.take_along_axis(s, index, axis=1)))))
    return np.stack(outputs)


def _bias_in_bfloat16(case: HFBlockCase) -> tuple[MoEConfig, MoEParams]:
    # The mistake: the bias kept in bfloat16 (8 significant bits): far from zero, nearby experts' biases merge.
    rounded = _bias(case).astype(ml_dtypes.bfloat16).astype(np.float64)
    return case.config, _with(case, **{"gate.e_score_correction_bias": rounded})


def _weight_on_expert_input(case: HFBlockCase) -> np.ndarray:
    p, x = case.params64, case.x64
    index, weights = _route(case, _scores(case), _bias(case))
    shared = _run(case, routing=(index, np.zeros_like(weights)))  # [m, d], the shared experts alone
    routed = np.zeros_like(x)
    for i in range(x.shape[0]):
        for r, e in enumerate(index[i]):
            h = weights[i, r] * x[i]  # the mistake: $$E_e(p_{i,e}\,x_i)$$ instead of $p_{i,e}\,E_e(x_i)$
            gate, up = p["experts.w1"][e] @ h, p["experts.w3"][e] @ h
            routed[i] += p["experts.w2"][e] @ (gate / (1 + np.exp(-gate)) * up)
    return shared + routed


# Where K3's code and a family's configuration class read an absent key differently: field -> K3's meaning.
_K3_ABSENT = {"routed_scaling_factor": 1.0, "num_shared_experts": 0, "renormalize": True}


def _absent_keys_as_k3(case: HFBlockCase) -> tuple[MoEConfig, MoEParams]:
    fields = _absent_k3_fields(case)
    params = case.params64
    if fields.get("num_shared_experts") == 0:  # no shared experts: K3's code builds none
        d = case.config.hidden_size
        params = _with(case, **{"shared_experts.gate_proj.weight": np.zeros((0, d)),
                                "shared_experts.up_proj.weight": np.zeros((0, d)),
                                "shared_experts.down_proj.weight": np.zeros((d, 0))})
    return case.config.replace(**fields), params


def _absent_k3_fields(case: HFBlockCase) -> dict[str, object]:
    """The fields whose key `case.text_config` leaves out, where K3's code would read another value."""
    if case.model_type is None:
        return {}
    keys = keys_family(kit_family(case.model_type)).keys
    return {field: value for field, value in _K3_ABSENT.items()
            if field in keys and keys[field].key not in case.text_config and getattr(case.config, field) != value}


def _bias_subtracted(case: HFBlockCase) -> tuple[MoEConfig, MoEParams]:
    # The mistake: selection by $$s - b$$ (a bias stored as $b = -\beta$ read with the other sign). The bias
    # only selects, so selecting by s - b is the layer with the bias negated.
    return case.config, _with(case, **{"gate.e_score_correction_bias": -_bias(case)})


def _bias_ignored(case: HFBlockCase) -> tuple[MoEConfig, MoEParams]:
    return case.config, _with(case, **{"gate.e_score_correction_bias": np.zeros_like(_bias(case))})


def _bias_on_logits(case: HFBlockCase) -> np.ndarray:
    s = _scores(case)
    logits = case.x64 @ case.params64["gate.weight"].T  # [m, n]
    # The mistake: $$\mathcal T_i = \operatorname{argtopk}(z_i + b)$$, with the weights still gathered from $s$.
    c = case.config
    index, _ = route(logits, _bias(case), c.top_k, renormalize=False, n_group=c.n_group, topk_group=c.topk_group)
    return _run(case, routing=(index, _weights(case, np.take_along_axis(s, index, axis=1))))


def _score_function_flipped(case: HFBlockCase) -> tuple[MoEConfig, MoEParams]:
    other = "softmax" if case.config.score_function == "sigmoid" else "sigmoid"
    return case.config.replace(score_function=other), case.params64


def _bf16_router(case: HFBlockCase) -> np.ndarray:
    bf16 = ml_dtypes.bfloat16
    x = case.x64.astype(bf16).astype(np.float32)  # [m, d]
    w = case.params64["gate.weight"].astype(bf16).astype(np.float32)  # [n, d]
    # The mistake: $$z = \operatorname{bf16}(x W_r^\top)$$, the GEMM's float32 result rounded to bfloat16.
    logits = (x @ w.T).astype(bf16).astype(np.float64)  # [m, n]
    s = np.asarray(score_function_values(logits, case.config.score_function))
    return _run(case, routing=_route(case, s, _bias(case)))


# ---------------------------------------------------------------------------
# Activation, norm, weights
# ---------------------------------------------------------------------------

def _up_cap_flipped(case: HFBlockCase) -> tuple[MoEConfig, MoEParams]:
    c = case.config
    return c.replace(situ_linear_beta=25.0 if c.situ_linear_beta is None else None), case.params64


def _gate_cap_k3_default(case: HFBlockCase) -> tuple[MoEConfig, MoEParams]:
    return case.config.replace(situ_beta=4.0), case.params64


def _silu_for_situ(case: HFBlockCase) -> tuple[MoEConfig, MoEParams]:
    return case.config.replace(activation="swiglu"), case.params64


def _latent_norm_dropped(case: HFBlockCase) -> tuple[MoEConfig, MoEParams]:
    params = MoEParams((k, v) for k, v in case.params64.items() if k != "routed_expert_norm.weight")
    return case.config.replace(use_latent_norm=False), params


def _gate_up_swapped(case: HFBlockCase) -> tuple[MoEConfig, MoEParams]:
    p = case.params64
    return case.config, _with(case, **{"experts.w1": p["experts.w3"], "experts.w3": p["experts.w1"]})


def _shared_experts_dropped(case: HFBlockCase) -> tuple[MoEConfig, MoEParams]:
    p = case.params64
    return case.config, _with(case, **{"shared_experts.down_proj.weight":
                                       np.zeros_like(p["shared_experts.down_proj.weight"])})


def _bf16(a: np.ndarray) -> np.ndarray:
    """`a` rounded to bfloat16 and back to float64."""
    return np.asarray(a, dtype=np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def _router_in_bfloat16(case: HFBlockCase) -> np.ndarray:
    c = case.config
    # The mistake: the whole router in bfloat16, each step rounded: $$z = \operatorname{bf16}(x W_r^\top)$$,
    # $s = \operatorname{bf16}(\sigma(z))$, selection on $\operatorname{bf16}(s + \operatorname{bf16}(b))$ (ties to the
    # lower id), weights $\operatorname{bf16}(s / \operatorname{bf16}(\sum s))$ times the factor, rounded.
    logits = _bf16(_bf16(case.x64) @ _bf16(case.params64["gate.weight"]).T)  # [m, n]
    s = _bf16(score_function_values(logits, c.score_function))  # [m, n]
    biased = _bf16(s + _bf16(_bias(case)))  # [m, n]
    index, _ = route(biased, np.zeros(c.num_experts), c.top_k, renormalize=False, n_group=c.n_group,
                     topk_group=c.topk_group)
    raw = np.take_along_axis(s, index, axis=1)  # [m, k]
    if c.renormalize:
        raw = _bf16(raw / _bf16(raw.sum(axis=1, keepdims=True)))
    return _run(case, routing=(index, _bf16(raw * c.routed_scaling_factor)))


def _norm_after_up_projection(case: HFBlockCase) -> np.ndarray:
    c, p = case.config, case.params64
    out = stable_latent_moe(case.x64, p, c, return_intermediates=True)
    # The mistake: $$y_{\text{routed}} = \operatorname{RMSNorm}(u W_\uparrow^\top) \odot g$$ instead of
    # $\operatorname{RMSNorm}(u) \odot g$ before the up-projection (the gain fits only when $\ell = d$).
    up = np.asarray(out.u) @ p["routed_expert_up_proj.weight"].T  # [m, d]
    routed = np.asarray(rms_norm(up, p["routed_expert_norm.weight"], c.rms_norm_eps))
    return np.asarray(out.y_shared) + routed


def _experts_summed_in_bfloat16(case: HFBlockCase) -> np.ndarray:
    c, p = case.config, case.params64
    out = stable_latent_moe(case.x64, p, c, return_intermediates=True)
    index, weights, z = np.asarray(out.index), np.asarray(out.weights), np.asarray(out.z)
    # Each slot's weighted expert output $p_{i,e} E_e(z_i)$, `[k, m, l]`.
    slots = [np.asarray(routed_experts(z, index[:, [r]], weights[:, [r]], p["experts.w1"], p["experts.w3"],
                                       p["experts.w2"], c)) for r in range(c.top_k)]
    # The mistake: $$u_i = \operatorname{bf16}(\dots\operatorname{bf16}(\operatorname{bf16}(o_1) + \operatorname{bf16}(o_2))\dots)$$,
    # the outputs added into a bfloat16 buffer in expert order instead of summed in float32.
    u = np.zeros_like(z)
    for i in range(z.shape[0]):
        for r in np.argsort(index[i], kind="stable"):  # expert by expert, as a loop over the experts adds them
            u[i] = _bf16(u[i] + _bf16(slots[r][i]))
    _, y_routed = latent_output(u, lambda name: p[name], c)
    return np.asarray(out.y_shared) + np.asarray(y_routed)


def _norm_eps_other(case: HFBlockCase) -> tuple[MoEConfig, MoEParams]:
    c = case.config
    # The mistake: $$\operatorname{rms}(u) = \sqrt{\operatorname{mean}(u^2) + \varepsilon'}$$ with the other
    # common epsilon, 1e-5 for 1e-6 or the reverse (a default taken from another model's config).
    return c.replace(rms_norm_eps=1e-5 if c.rms_norm_eps != 1e-5 else 1e-6), case.params64


# ---------------------------------------------------------------------------
# MXFP4
# ---------------------------------------------------------------------------

def _decoded(case: HFBlockCase, decode: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """The case with every routed expert decoded from its stored bytes by `decode(packed, scale)`."""
    stacks = {name: decode(packed, scale) for name, (packed, scale) in case.expert_bytes.items()}
    return _run(case, params=_with(case, **stacks))


def _nibbles_swapped(case: HFBlockCase) -> np.ndarray:
    def decode(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
        # The mistake: the high nibble taken as the even column.
        swapped = ((packed & 0x0F) << 4) | (packed >> 4)
        return mxfp4_decode(swapped.astype(np.uint8), scale, dtype=np.float64)
    return _decoded(case, decode)


def _e8m0_bias_125(case: HFBlockCase) -> np.ndarray:
    # The mistake: $$X = 2^{s - 125} = 4 \cdot 2^{s - 127}$$
    return _decoded(case, lambda packed, scale: 4.0 * mxfp4_decode(packed, scale, dtype=np.float64))


def _e8m0_as_e4m3(case: HFBlockCase) -> np.ndarray:
    def decode(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
        unit = mxfp4_decode(packed, np.full_like(scale, 127), dtype=np.float64)  # the E2M1 values, X = 1
        # The mistake: the scale byte read as an E4M3 number instead of the exponent $2^{s-127}$.
        x = scale.view(ml_dtypes.float8_e4m3fn).astype(np.float64)  # [..., in/32]
        blocks = unit.reshape(*scale.shape, -1) * x[..., None]
        return blocks.reshape(unit.shape)
    return _decoded(case, decode)


# ---------------------------------------------------------------------------
# The catalogue
# ---------------------------------------------------------------------------

def _always(case: HFBlockCase) -> bool:
    return True


def _scaled(case: HFBlockCase) -> bool:
    return case.config.routed_scaling_factor != 1.0


def _grouped(case: HFBlockCase) -> bool:
    c = case.config
    return c.n_group > 1 and c.topk_group < c.n_group and c.num_experts // c.n_group >= 2


def _top1_with_renormalize_key(case: HFBlockCase) -> bool:
    """A top-1 case whose renormalization key says true (or is absent and means true), which K3's code ignores."""
    key, absent = case.renormalize_key
    return case.config.top_k == 1 and case.text_config.get(key, absent) is not False


def _changing(name: str, summary: str, issue: str | None, applies: Callable[[HFBlockCase], bool],
              change: Change) -> Convention:
    """An entry that is a change of the config or the weights: its output is the layer computed with the change
    made, so it can be assumed (`assume`) and composed with the others."""
    def output(case: HFBlockCase) -> np.ndarray:
        config, params = change(case)
        return _run(case, config=config, params=params)
    return Convention(name, summary, issue, applies, output, change=change)


#: Every catalogued convention difference, in the order a report lists them.
CATALOGUE: tuple[Convention, ...] = (
    Convention("bias_in_weights", "the mixture weights taken from the biased scores s + b instead of the raw s",
               "vLLM #12002; transformers #41647", _always, _bias_in_weights),
    _changing("scale_applied_twice", "routed_scaling_factor multiplied into the weights twice",
               "vLLM #24119; kvcache-ai/sglang #86", _scaled, _scale_applied_twice),
    _changing("scale_skipped_without_renormalization",
               "routed_scaling_factor dropped on the path that does not renormalize the weights",
               "sglang-jax #1282", lambda c: _scaled(c) and not c.config.renormalize, _scale_never_applied),
    _changing("scale_never_applied", "routed_scaling_factor never applied", None, _scaled, _scale_never_applied),
    _changing("top1_renormalized",
               "with top_k = 1 the single weight renormalized to 1 (the reference keeps the raw score)", None,
               lambda c: c.k3_rules and _top1_with_renormalize_key(c), _top1_renormalized),
    _changing("top1_kept_raw",
               "with top_k = 1 the single weight kept raw, as K3's code does (this model renormalizes it to 1)",
               None, lambda c: not c.k3_rules and c.config.top_k == 1 and c.config.renormalize,
               _renormalization_flipped),
    _changing("renormalization_flipped", "the renormalization switch (moe_renormalize, norm_topk_prob) read the "
               "other way", None, lambda c: c.config.top_k > 1 or not c.k3_rules,
               _renormalization_flipped),
    Convention("groups_by_max", "a group scored by its best expert instead of the sum of its two best",
               "vLLM #13474, #46869", _grouped, _groups_by_max),
    Convention("groups_masked_with_zero", "the experts of dropped groups masked with 0 instead of -inf (with "
               "negative biased scores they are chosen)", None, _grouped, _groups_masked_with_zero,
               _groups_masked_with_zero_resolutions),
    _changing("bias_subtracted", "experts selected by s - b instead of s + b", None, _always, _bias_subtracted),
    _changing("bias_in_bfloat16", "the selection bias e_score_correction_bias kept in bfloat16 (far from zero, "
               "nearby biases merge)", None, _always, _bias_in_bfloat16),
    _changing("bias_ignored", "experts selected by s alone (e_score_correction_bias not loaded or not added)",
               None, _always, _bias_ignored),
    Convention("bias_on_logits", "experts selected by the raw logits plus the bias, z + b, instead of the scores "
               "s + b (the weights still from s)", "Megatron-Core's Quantile Balancing router", _always,
               _bias_on_logits),
    _changing("score_function_flipped", "moe_router_activation_func ignored: sigmoid for softmax or the reverse",
               None, _always, _score_function_flipped),
    Convention("bf16_router", "the router logits computed in bfloat16 instead of float32", "SGLang PR #33764",
               _always, _bf16_router),
    Convention("router_in_bfloat16", "the whole router in bfloat16: logits, scores, s + b and the selection, "
               "and the weights, each rounded to bfloat16", "MaxText's default router dtype", _always,
               _router_in_bfloat16),
    _changing("up_cap_flipped", "the up branch capped at 25 when activation_situ_linear_beta is absent, or "
               "left uncapped when it is set", None, _situ, _up_cap_flipped),
    _changing("gate_cap_k3_default", "an absent activation_situ_beta read as K3's 4.0 instead of the "
               "reference's 1.0", None,
               lambda c: _situ(c) and not c.text_config.get("activation_situ_beta"), _gate_cap_k3_default),
    _changing("silu_for_situ", "SiLU (SwiGLU) in place of SiTU", "Megatron-LM discussion #6673", _situ,
               _silu_for_situ),
    _changing("latent_norm_dropped", "the latent RMSNorm skipped", "a Megatron-LM fork, #94",
               lambda c: c.config.use_latent_norm, _latent_norm_dropped),
    Convention("norm_after_up_projection", "the latent RMSNorm applied after the up-projection, to u W_up, "
               "instead of to the latent sum u", None,
               lambda c: c.config.use_latent_norm and c.config.latent_size == c.config.hidden_size,
               _norm_after_up_projection),
    _changing("norm_eps_other", "the latent norm's epsilon taken as 1e-5 where the config says 1e-6, or the "
               "reverse", None, lambda c: c.config.use_latent_norm, _norm_eps_other),
    Convention("experts_summed_in_bfloat16", "the routed experts' weighted outputs added into a bfloat16 "
               "buffer, expert by expert, instead of summed in float32", None,
               _always, _experts_summed_in_bfloat16),
    _changing("gate_up_swapped", "w1 read as the up projection and w3 as the gate", None, _always,
               _gate_up_swapped),
    Convention("weight_on_expert_input", "the routing weight applied to the expert's input, E(p x), instead of "
               "its output, p E(x) (Llama 4's convention)", None,
               lambda c: not c.config.use_latent_projection and c.config.activation == "swiglu",
               _weight_on_expert_input),
    _changing("absent_keys_as_k3", "absent keys read with K3's code's meaning (routed_scaling_factor 1.0, no "
               "shared experts, renormalized) instead of the model's configuration class defaults", None,
               lambda c: bool(_absent_k3_fields(c)), _absent_keys_as_k3),
    _changing("shared_experts_dropped", "the shared experts left out", None,
               lambda c: c.config.num_shared_experts > 0, _shared_experts_dropped),
    Convention("mxfp4_nibbles_swapped", "MXFP4: the high nibble of each byte read as the even column", None,
               lambda c: c.mxfp4, _nibbles_swapped),
    Convention("e8m0_bias_125", "MXFP4: E8M0 scales read as 2^(s - 125) instead of 2^(s - 127)",
               "compressed-tensors #538", lambda c: c.mxfp4, _e8m0_bias_125),
    Convention("e8m0_as_e4m3", "MXFP4: E8M0 scale bytes read as E4M3 numbers", "b12x #116",
               lambda c: c.mxfp4, _e8m0_as_e4m3),
)

_BY_NAME = {entry.name: entry for entry in CATALOGUE}


def convention(name: str) -> Convention:
    """The catalogue entry called `name`."""
    if name not in _BY_NAME:
        raise ValueError(f"no catalogued convention {name!r}; the catalogue holds {sorted(_BY_NAME)}")
    return _BY_NAME[name]


def assume(case: HFBlockCase, differences: Iterable[str | Convention]) -> HFBlockCase:
    """`case` with catalogued `differences` assumed, in order: its `expected()` is the output of a block that has
    them all (each one computed on what the ones before it left).

    The tokens and the `state_dict` a block is handed are unchanged. Only entries that are a change of the config
    or the weights (`Convention.composable`) can be assumed; another is a `ValueError` naming it. A difference
    that does not apply to the case (`top1_renormalized` on a top-2 case) changes nothing. The entries run on the
    result give the output of a block with the assumed differences and theirs: how a check names a second
    difference behind a first one that changes every output.
    """
    entries = tuple(convention(d) if isinstance(d, str) else d for d in differences)
    for entry in entries:
        if not isinstance(entry, Convention):
            raise TypeError(f"differences must be catalogue names or entries, got {type(entry).__name__}")
        if not entry.composable:
            raise ValueError(f"{entry.name} cannot be assumed: its variant computes a route or an output another "
                             "way, not a change of the config or the weights")
    return replace(case, assumed=case.assumed + entries)
