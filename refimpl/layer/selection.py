r"""Step 2 of a layer as its configuration describes it: the extension points where the other systems enter.

`select_experts(scores, bias, config)` is the one function that every path
of the package calls for step 2 of Eq. (11) (the forward, the backward,
expert parallelism, the training loop). For K3 it is Eq. (13) and nothing
else: `refimpl.layer.routing.route`, the top-$k$ of $s + b$ with weights from
the raw scores. The systems K3 is compared with enter through two named
extension points, each a table written out below, so that reading this page
says every rule a layer can run:

* a **choice rule** (`EXPERT_CHOICE`): K3's biased top-$k$, or the hash
  routing of DeepSeek-V4 (`refimpl.layer.baselines.hash_choice`), which
  reads the token ids;
* a **serving rule** (`SERVING`): a capacity that drops what an expert has no
  room for (`refimpl.layer.baselines.capacity_serving`).

The K3 code of `refimpl.layer.routing` does not branch on them, and nothing
registers itself here as a side effect of being imported: a new rule is one
more entry in a table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .._lib.xp import Array, array_namespace, dtype_name, is_array
from ..config import MoEConfig
from .baselines import capacity_serving, hash_choice
from .routing import route

__all__ = ["EXPERT_CHOICE", "SERVING", "ChoiceRule", "Selection", "ServingRule", "biased_top_k", "check_token_ids",
           "select_experts", "serving_rule"]

# ---------------------------------------------------------------------------
# A layer's selection, and its extension points
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Selection:
    """Step 2 of a layer: which experts each token visits, and with what weight.

    `index` `[m, k]` holds each token's experts in rank order (best first),
    `weights` `[m, k]` their mixture weights, zero where an assignment was
    dropped; `kept` `[m, k]` bool says which assignments were served (None
    when every one is, as in K3).
    """

    index: Array
    weights: Array
    kept: Array | None = None


def biased_top_k(scores: Array, bias: Array, config: MoEConfig, token_ids: Array | None = None) -> tuple[Array, Array]:
    r"""K3's choice rule, Eq. (13) with the layer's switches: `route` by $s + b$, weights from the raw $s$."""
    return route(scores, bias, config.top_k, renormalize=config.renormalize,
                 scaling_factor=config.routed_scaling_factor, n_group=config.n_group, topk_group=config.topk_group)


#: A choice rule: `(scores [m, n], bias [n], config, token_ids [m] or None) -> (index [m, k], weights [m, k])`.
ChoiceRule = Callable[[Array, Array, MoEConfig, "Array | None"], tuple[Array, Array]]
#: A serving rule: `(index [m, k], weights [m, k], config) -> (weights [m, k], kept [m, k] bool)`.
ServingRule = Callable[[Array, Array, MoEConfig], tuple[Array, Array]]

#: How a layer chooses its experts, by name. K3's rule is `"biased-top-k"`; a layer with
#: `config.hash_routing` uses `"hash"` (the page "The other routers and balancers").
EXPERT_CHOICE: dict[str, ChoiceRule] = {"biased-top-k": biased_top_k, "hash": hash_choice}

#: Which of the chosen assignments a layer serves, by name, when not all of them: a layer with a
#: `config.capacity_factor` uses `"capacity"` (the page "The other routers and balancers").
SERVING: dict[str, ServingRule] = {"capacity": capacity_serving}


def _registered(table: dict, name: str, switch: str) -> Callable:
    if name not in table:
        raise ValueError(f"{switch} needs the rule {name!r}, which is not in the table (known: {sorted(table)})")
    return table[name]


def serving_rule(name: str) -> ServingRule:
    """The serving rule registered as `name` (`"capacity"`), or a `ValueError` saying it is not registered."""
    return _registered(SERVING, name, f"the serving rule {name!r}")


def check_token_ids(token_ids: Array | None, m: int, config: MoEConfig) -> None:
    """The `token_ids` of `m` tokens: required when `config.hash_routing`; when given, integers of shape `[m]`.

    Checked whenever they are given, hash routing or not, so that a call is
    refused or accepted the same on one process and across ranks (where a
    rank's bad ids must be known before the ranks exchange anything). A
    hash-routed layer hashes ids in $[0, 2^{32})$ (`hash_route`); the range
    is checked then. A `TypeError` or `ValueError` naming `token_ids`, with
    what was expected and what came.
    """
    if token_ids is None:
        if config.hash_routing:
            raise ValueError(f"token_ids must be given (one integer id per token of x, shape [{m}]) "
                             f"when config.hash_routing is True, got None")
        return
    if not is_array(token_ids):
        raise TypeError(f"token_ids must be an integer array of shape [{m}], got {type(token_ids).__name__}")
    xp = array_namespace(token_ids)
    if not xp.isdtype(token_ids.dtype, "integral"):
        raise TypeError(f"token_ids must be an integer array of shape [{m}], got dtype {dtype_name(token_ids.dtype)}")
    if tuple(token_ids.shape) != (m,):
        raise ValueError(f"token_ids must have shape [{m}] (one id per token of x), got {list(token_ids.shape)}")
    if config.hash_routing and m:
        low, high = int(xp.min(token_ids)), int(xp.max(token_ids))
        if low < 0 or high >= 2**32:
            raise ValueError(f"token_ids must hold integers in [0, {2**32}) for hash routing, "
                             f"got values in [{low}, {high}]")


def select_experts(scores: Array, bias: Array, config: MoEConfig, *, token_ids: Array | None = None) -> Selection:
    r"""Step 2 of a layer with the switches of `config`: the experts of each token and their weights.

    For K3 this is Eq. (13) and nothing else: the top-$k$ of $s + b$, the raw
    scores of the chosen experts renormalized and scaled (`biased_top_k`).
    The switches of the systems K3 is compared with call the rules
    registered under their names instead, through the same function, so
    every path of the package (the forward, the backward, expert parallelism,
    training) selects the same way:

    * `config.hash_routing`: the experts come from the `"hash"` choice rule,
      a fixed function of `token_ids` (`[m]` integers, required then);
    * `config.capacity_factor`: the `"capacity"` serving rule keeps at most
      $C = \lceil c\,mk/n \rceil$ assignments per expert; a dropped
      assignment's weight becomes 0 (`kept` says which).
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    check_token_ids(token_ids, int(scores.shape[0]), config)
    if config.hash_routing:
        choose = _registered(EXPERT_CHOICE, "hash", "config.hash_routing=True")
    else:
        choose = EXPERT_CHOICE["biased-top-k"]
    index, weights = choose(scores, bias, config, token_ids)  # [m, k] each
    if config.capacity_factor is None:
        return Selection(index, weights)
    serve = _registered(SERVING, "capacity", f"config.capacity_factor={config.capacity_factor}")
    weights, kept = serve(index, weights, config)  # [m, k], [m, k] bool
    return Selection(index, weights, kept)
