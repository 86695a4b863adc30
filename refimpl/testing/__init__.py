r"""Test your own router: the conformance kit.

A production MoE layer is rewritten many times: in PyTorch for training, in
Triton or CUDA for speed, in JAX, in an inference engine. Each rewrite can
get Eq. (13) and Eq. (14) subtly wrong in ways a loss curve hides for weeks: the
bias leaks into the mixture weights, a bias stored in bfloat16 drifts away
from zero and stops separating the experts, a quantile is read one rank off.
`refimpl.testing` tests such code directly against this reference and
against the invariants the paper implies.

```python
import numpy as np
from refimpl.testing import check_router

def my_router(scores, bias, top_k):           # NumPy in, NumPy out
    biased = scores + bias
    index = np.argsort(-biased, axis=1, kind="stable")[:, :top_k]
    raw = np.take_along_axis(scores, index, axis=1)
    return index, raw / raw.sum(axis=1, keepdims=True)

check_router(my_router, tie_order="lower_id")  # raises AssertionError with a report if wrong
```

Put that call in a test function and pytest runs it like any other test.

## What the kit checks

Each check takes a callable with the signature of the matching reference
function. Inputs and outputs are NumPy arrays, so code in any framework fits
behind a few lines that convert them (a PyTorch router behind such an adapter
is shown with the kit's installation).

| check | your callable | compared with | invariants beyond agreement |
|---|---|---|---|
| `check_router` | `fn(scores, bias, top_k) -> (index, weights)`; with `model_type`, `fn(logits, bias, text_config)` | `route` (with the family's score function, groups and renormalization) | distinct ids; weights from the raw scores, summing to the scaling factor; a common shift of the bias changes nothing; experts only from the chosen groups; a valid top-$k$ under ties; lower id first on ties (if you declare it) |
| `check_balancing_update` | `fn(scores, bias, top_k) -> new_bias` | `quantile_balancing_update` | centred; bias-shift invariant; token-permutation invariant; expert-permutation equivariant |
| `check_histogram_update` | `fn(blocks, bias, top_k) -> new_bias` | Eq. (14), within one bin | the same, plus the same bias for any split of the batch over ranks and micro-batches |
| `check_balancer` | `make(initial_bias, top_k) -> step`, `step(scores) -> index` | `route` with the biases of Eq. (14) | no look-ahead: a batch is routed with a bias fixed before it was seen |
| `check_forward` | `fn(x, params, config) -> y` | `stable_latent_moe` | within the `rtol`/`atol` you choose for your dtype |
| `check_capacity` | `fn(index, weights, num_experts, capacity) -> (kept, new_weights)` | `capacity_keep` (or, declared with `order="token_major"`, MaxText's token-major order) | capacity never exceeded; nothing dropped without need; rank order, then token order; no renormalization after a drop |
| `check_hf_moe_block` | `build(text_config, state_dict) -> forward`, `forward(x) -> y` | `stable_latent_moe` on the same weights | configurations of K3's modeling code (or, with `model_type`, of DeepSeek-V3, GLM-4 MoE, Kimi Linear, Qwen3-MoE, Mixtral or Nemotron-H in transformers, or of K3 in transformers' draft), MXFP4 experts, biases shifted far from zero; one build asked several inputs; a failure names every catalogued convention difference that reproduces it (`conventions.CATALOGUE`) |

`check_hf_moe_block` is the way in for a whole block written against
Hugging Face names (an `nn.Module` that loads the checkpoint's tensors): it
hands your `build` the config keys and the tensors, and
`refimpl.params_from_hf_state_dict` does the same conversion for your own
tests. A port of another model passes `model_type="deepseek_v3"` (or
`"glm4_moe"`, `"kimi_linear"`, `"qwen3_moe"`, `"mixtral"`, `"nemotron_h"`) and is held to that
model's keys, tensor names and rules. The page "Conventions across frameworks" lists what its catalogue
tells apart.

A port of K3 in transformers' draft layout (its `KimiK3MoE`) passes
`model_type="kimi_k3"`. The keys are the draft's: DeepSeek-V3's
configuration keys plus `routed_expert_hidden_size`, `activation_situ_beta`
and `activation_situ_linear_beta`. The tensors are its block's:
`experts.gate_up_proj` `[n, 2f, l]` (gate rows first), `experts.down_proj`
`[n, l, f]`, `routed_expert_down_proj`, `routed_expert_norm`,
`routed_expert_up_proj`, `gate.weight`, `gate.e_score_correction_bias` and
`shared_experts.*`. The output is held to K3's code: a single chosen weight
stays the raw score, where the draft's DeepSeek-V3 router renormalizes it
(named `top1_renormalized`; a port that keeps the draft's router declines
`num_experts_per_tok == 1` with `Unsupported`). K3's latent norm divides a
single weight out again but for its epsilon, so a pass says on how many
top-1 cases the two could be told apart, or that none could.

Why invariants and not only agreement: a disagreement says *that* something
is wrong; a broken invariant often says *what*. A router that subtracts the
bias instead of adding it still passes the bias-shift invariance and fails
only the selection; a router that stores its bias in bfloat16 picks the right
experts while the bias sits near zero and fails as soon as the same bias is
shifted by 10. The catalogue below shows each one.

## How a check runs

Every invariant is a separate [Hypothesis](https://hypothesis.readthedocs.io)
property. Hypothesis draws small inputs (a few tokens, a few experts) from the
strategies of `refimpl.testing.strategies`, and when an input breaks the
invariant it **shrinks** it to the simplest input that still does. The check
runs every invariant, collects the ones that broke and raises `CheckFailure`,
an `AssertionError` whose message lists each broken invariant with

* why it must hold (the equation or section it comes from),
* what broke, in words, with the expected and the actual values,
* the largest absolute and relative error where numbers are compared,
* the shrunk input, printed as NumPy code you can paste to reproduce it.

The inputs are built so that a correct float32 implementation never fails
on rounding alone: routing inputs have no two biased scores closer than
$2^{-14}$ (without rejecting any example; see `strategies.routing_cases`),
and the forward check leaves out tokens whose routing is ambiguous at the
user's precision.

## Settings

`settings` takes a profile name or any `hypothesis.settings`:

* `"quick"` (the default): 50 examples per invariant, the same every run,
  a few seconds per check;
* `"thorough"`: 300 random examples per invariant, for CI.

The environment variable `REFIMPL_TESTING_PROFILE=thorough` switches the
default for a whole test session. The profiles never write an example
database into your directory and never time out a slow first call.

A slow first call is never timed out, but a call that hangs can be:
`with call_deadline(5.0): check_router(my_router)` gives every call of
your code at most five seconds, and one that takes longer is reported as
a broken invariant (the call itself is left running in a background
thread, since Python cannot stop it).

## A router of another family

`check_router(fn, model_type="qwen3_moe")` (or `"mixtral"`, `"deepseek_v3"`,
...) checks a family's router at the router level: `fn(logits, bias,
text_config)` gets float32 logits, the family's selection bias or `None`
(softmax families have none, and no bias is drawn for them), and the
family's config keys, with groups drawn where the family has them. It is
held to that family's rules: its score function, the group mask, and its
rule for a single chosen weight (DeepSeek-V3 renormalizes it when
`norm_topk_prob`; K3's code keeps it raw). `hidden_size` in those keys is the
number of experts, so transformers' own router module, built from the keys
with an identity gate weight, takes the logits as its hidden states.

## What a check covered, and keys a port fixes

Every result says how many cases each invariant covered and how many your
code declined with `Unsupported`: `print(check_hf_moe_block(build))` after a
pass shows one line per invariant (`result.covered` and `result.declined` are
the totals), and a failure's report ends with the same lines. A port that
fixes some configuration keys (always SiTU, always the latent norm) pins them,
`check_hf_moe_block(build, pinned={"hidden_act": "situ",
"latent_moe_use_norm": True})`, and every draw keeps them, so the draws are
spent on what the port covers instead of being declined.

## Every difference, not only the first

When `check_hf_moe_block`'s comparison fails and a catalogue entry names the
difference, the comparison runs again with that difference assumed: the port
is compared with the reference computed with it
(`refimpl.testing.conventions.assume`), on every case, and what is left is
named against variants that have both differences. So a port with two
differences is reported with both names, each with its own pasteable case,
even when the first changes every output (`w1` and `w3` swapped, and the
shared experts left out, say). An entry that is not a change of the config
or the weights (the weights from $s + b$, a bfloat16 sum) cannot be assumed:
the next round leaves out ("scopes out") the cases on which it shows, and
fails, saying so, when that leaves too few to check anything. A port that
computes in float32 when asked for float64 is named as such, and the next
round holds it at float32's tolerance.

## Cases your port does not cover

A port need not cover everything the kit draws: a DeepSeek-style block
has no latent path, a port may route to one expert only. Raise
`refimpl.testing.Unsupported("why")` from your function (or your `build`)
for such a case, and the check draws another instead. A declined case is
neither a pass nor a failure; an invariant that covered fewer than
`MIN_COVERED` (10) cases fails, saying how many were declined and why, so a
check that saw almost nothing never passes for one that saw enough.

## What the kit refuses to be fooled by

A block is built once and asked several batches: a forward that returns its
answer to an earlier input, or one output buffer that its next call writes
over, the caller's earlier answer with it ("stale output"), or whose answer to the same
input changes from call to call ("drift"), fails, and so does a build that
writes into the `state_dict` or `text_config` it was handed, then or later
from its forward. A check asked for float64 holds float64's tolerance, and
its report says the precision the port achieved; the router, forward,
update and histogram checks do too, by default: their tolerances are the
float32 ones scaled by float64's unit roundoff over float32's, $2^{-29}$, so a
port that computes in float32 fails a float64 check (in a half dtype, pass the
tolerance your port needs). A bfloat16 router is not failed for the ties the
cast to bfloat16 itself makes: such a token is held to a valid top-$k$. A
balancer is started from a nonzero initial bias, so one that ignores it
fails, and a balancer whose steps write into that bias or into the batches
it was handed is reported, naming them. A router that declares the
lower id first on ties is tried on rows of 17 to 32 experts as well as short
ones: sorts that are unstable in general (`np.argsort`'s default kind where
NumPy has no vectorized sort for the CPU, libstdc++'s `std::sort`) order a
row of up to 16 values by insertion, which keeps ties in id order, so short
rows alone would let them pass.

Your function receives copies of the inputs, so the reference never sees
what it did to them; and if it writes into them, that is reported,
naming the argument ("the function wrote into its inputs scores, bias"):
a router's caller weighs the experts with the same scores that feed the
next bias. What your function returns is converted with `np.asarray`; a
value NumPy cannot convert (a GPU array, a tensor that requires grad) is
a failed invariant that names the conversion, not an error from inside
the check.

## Your own properties

The strategies are public: `strategies.routing_cases()`, `scores()`,
`biases()`, `bias_shifts()`, `configs()`, `token_batches()`,
`forward_cases()`, `partitions()`, `batch_sequences()`. Use them with
`@given` for properties of your own, for example that your fused kernel and
your eager code agree on inputs with no near-ties.
"""

try:
    import hypothesis  # noqa: F401  (the one dependency of the kit that the rest of refimpl lacks)
except ImportError as exc:
    raise ImportError(
        "refimpl.testing runs its checks with Hypothesis, which is not installed; "
        "install it with: pip install 'refimpl[testing]' (or: pip install hypothesis)"
    ) from exc

from . import strategies
from .balancer_check import check_balancer
from .capacity_check import check_capacity
from .conventions import CATALOGUE, Convention
from .forward_check import check_forward
from .hf_block_check import check_hf_moe_block
from .hf_cases import HFBlockCase, hf_block_case, hf_block_cases, hf_family_text_configs, hf_text_configs
from .histogram_check import check_histogram_update
from .lifecycle_check import check_balancer_lifecycle
from .profiles import PROFILES, QUICK, THOROUGH, profile
from .report import CheckFailure, CheckResult, Unsupported, call_deadline
from .router_check import check_router
from .update_check import check_balancing_update

__all__ = [
    "CATALOGUE",
    "HFBlockCase",
    "PROFILES",
    "QUICK",
    "THOROUGH",
    "Unsupported",
    "CheckFailure",
    "CheckResult",
    "Convention",
    "call_deadline",
    "check_balancer",
    "check_balancer_lifecycle",
    "check_balancing_update",
    "check_capacity",
    "check_forward",
    "check_hf_moe_block",
    "check_histogram_update",
    "check_router",
    "conventions",
    "hf_block_case",
    "hf_block_cases",
    "hf_family_text_configs",
    "hf_text_configs",
    "profile",
    "strategies",
]
