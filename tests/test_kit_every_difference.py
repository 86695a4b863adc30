"""Every difference, not the first: `check_hf_moe_block` names a second difference behind one on every case.

When "matches the reference block" fails with a named difference, the next round assumes it: the port is
compared with the reference computed with that difference (`refimpl.testing.conventions.assume`), and what
is left is named against variants that have the first difference too. So:

* a port with two planted differences, the first of which changes every output, has both named, each with
  its own case, and the round after them holds on enough cases;
* a port with one difference has exactly that one named, and the round that assumes it holds;
* a correct port passes, with no further round;
* a first difference that cannot be assumed (a route or output computed another way) is scoped out as
  before, and the round that is left nothing fails saying so, naming what it scoped out;
* `assume` composes the catalogue's entries: assuming an entry gives its output, and the entries run on an
  assumed case give the output of a block with both differences.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hf_reference_block import build_block, planted
from hypothesis import settings

import refimpl
import refimpl.testing as kit
from refimpl.testing import CATALOGUE, CheckFailure, check_hf_moe_block, hf_block_case
from refimpl.testing import conventions as catalogue
from refimpl.testing.conventions import convention
from refimpl.testing.report import MIN_COVERED

pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op:UserWarning")

FEW = settings(kit.QUICK, max_examples=15)  # these ports fail on most cases; the tests are about the report
MATCHES = "matches the reference block"


def _failure(build, **options) -> CheckFailure:
    """The CheckFailure `check_hf_moe_block` raises on `build` (the test fails if the check passes)."""
    options = {"mxfp4": False, "settings": FEW, **options}
    with pytest.raises(CheckFailure) as info:
        check_hf_moe_block(build, **options)
    return info.value


def _rounds(failure: CheckFailure) -> list:
    """The failed rounds of "matches the reference block", in the order they ran."""
    return [v for v in failure.violations if v.invariant.name.startswith(MATCHES)]


def _named(failure: CheckFailure) -> list[str]:
    return [name for v in _rounds(failure) for name in v.conventions]


def _assumed(names: list[str]) -> str:
    return f"{MATCHES}, with {', '.join(names)} assumed"


def _pasted_case(violation):
    """The case a violation's report prints, rebuilt from its pasteable lines."""
    text_config = json.loads(eval(str(violation.inputs["text_config"])[len("json.loads("):-1]))
    call = str(violation.inputs["case"])
    return text_config, eval(call, {"refimpl": refimpl, "np": np, "text_config": text_config})


# ---------------------------------------------------------------------------
# Two differences, the first on every case: both named
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("mistakes", [
    ("gate_up_swapped", "shared_experts_dropped"),  # w1/w3 swapped changes every output
    ("gate_up_swapped", "shared_experts_dropped", "scale_applied_twice"),  # and a third behind both
])
def test_differences_behind_one_on_every_case_are_each_named_with_its_case(mistakes):
    failure = _failure(planted(*mistakes))
    named = _named(failure)  # in the order the rounds found them
    assert sorted(named) == sorted(mistakes), str(failure)
    rounds = _rounds(failure)
    assert mistakes[0] == named[0] and len(rounds) == len(mistakes)
    for number, v in enumerate(rounds):  # round n assumes the n differences named before it
        assert v.invariant.name == (_assumed(named[:number]) if number else MATCHES), str(failure)
        assert v.conventions == [named[number]], str(failure)
        assert str(v.inputs["case"]).startswith("refimpl.testing.hf_block_case("), str(failure)
    # The round that assumes every difference holds, on enough cases, none of them scoped out.
    last = _assumed(named)
    assert last in failure.passed, str(failure)
    assert failure.coverage[last].covered >= MIN_COVERED and failure.coverage[last].scoped_out == 0
    report = str(failure)
    assert f"Distinct differences named: {', '.join(named)}" in report
    for name in mistakes:
        assert f"- {convention(name).describe()}" in report
    assert "could not check anything" not in report


def test_the_second_difference_reproduces_on_its_pasted_case():
    """The second round's case, pasted, shows the second difference against the first assumed."""
    build = planted("gate_up_swapped", "shared_experts_dropped")
    second = _rounds(_failure(build))[1]
    assert "assume(case, ['gate_up_swapped']).expected()" in str(second.inputs["y"])
    assert "with gate_up_swapped assumed" in second.summary
    text_config, case = _pasted_case(second)
    y = build(text_config, case.state_dict)(case.x).astype(np.float64)
    scale = np.max(np.abs(case.expected()))
    first_only = catalogue.assume(case, ["gate_up_swapped"]).expected()
    both = catalogue.assume(case, ["gate_up_swapped", "shared_experts_dropped"]).expected()
    assert np.max(np.abs(y - first_only)) > 1e-3 * scale  # the second difference shows on this case
    assert np.max(np.abs(y - both)) < 1e-4 * scale  # and the two assumed together reproduce the port


# ---------------------------------------------------------------------------
# One difference: exactly that one; a correct port: none
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("mistake", ["gate_up_swapped", "shared_experts_dropped", "scale_applied_twice"])
def test_a_port_with_one_difference_gets_exactly_that_name_and_the_assumed_round_holds(mistake):
    failure = _failure(planted(mistake))
    assert failure.failed == [MATCHES], str(failure)
    assert _named(failure) == [mistake], str(failure)
    assumed = _assumed([mistake])
    assert assumed in failure.passed, str(failure)
    assert failure.coverage[assumed].covered >= MIN_COVERED and failure.coverage[assumed].scoped_out == 0
    assert "Distinct differences named" not in str(failure)


def test_a_correct_port_passes_with_one_round():
    result = check_hf_moe_block(build_block, mxfp4=False, settings=FEW)
    rounds = [name for name in result.passed if name.startswith(MATCHES)]
    assert rounds == [MATCHES]
    assert result.coverage[MATCHES].covered >= MIN_COVERED


# ---------------------------------------------------------------------------
# A first difference that cannot be assumed: scoped out, and a round left nothing fails saying so
# ---------------------------------------------------------------------------

def test_a_difference_that_cannot_be_assumed_is_scoped_out_and_the_empty_round_says_so():
    failure = _failure(planted("experts_summed_in_bfloat16", "shared_experts_dropped"))
    assert _named(failure)[0] == "experts_summed_in_bfloat16", str(failure)
    scoped = f"{MATCHES}, with experts_summed_in_bfloat16 scoped out"
    assert scoped in failure.failed and scoped not in failure.passed, str(failure)
    summary = next(v for v in failure.violations if v.invariant.name == scoped).summary
    assert summary.startswith("could not check anything beyond experts_summed_in_bfloat16"), summary
    assert "cannot be assumed" in summary and "scoped out" in summary
    assert failure.coverage[scoped].covered < MIN_COVERED


# ---------------------------------------------------------------------------
# assume: the catalogue's entries as changes that compose
# ---------------------------------------------------------------------------

TEXT = {"hidden_size": 6, "routed_expert_hidden_size": 4, "latent_moe_use_norm": True, "num_experts": 8,
        "num_experts_per_token": 2, "moe_intermediate_size": 3, "num_shared_experts": 1, "hidden_act": "situ",
        "activation_situ_linear_beta": 3.0, "routed_scaling_factor": 2.5, "moe_renormalize": False,
        "num_expert_group": 4, "topk_group": 2}
CASES = [hf_block_case(TEXT, 1, tokens=6, activation_scale=6.0),
         hf_block_case(dict(TEXT, num_experts_per_token=1, moe_renormalize=True, latent_moe_use_norm=False), 2,
                       tokens=6),
         hf_block_case({"model_type": "deepseek_v3", "hidden_size": 8, "n_routed_experts": 8,
                        "num_experts_per_tok": 2, "moe_intermediate_size": 4, "n_group": 2, "topk_group": 1,
                        "num_hidden_layers": 1, "first_k_dense_replace": 0}, 4, tokens=6, model_type="deepseek_v3")]


def _composable() -> list:
    """The entries that can be assumed (a function, so that this module imports on a kit without them)."""
    return [entry for entry in CATALOGUE if entry.composable]


def test_assuming_an_entry_gives_its_output_and_leaves_what_the_block_is_handed():
    for case in CASES:
        for entry in _composable():
            assumed = catalogue.assume(case, [entry.name])
            expected = entry.output(case) if entry.applies(case) else case.expected()
            np.testing.assert_array_equal(assumed.expected(), expected, err_msg=entry.name)
            assert assumed.state_dict.keys() == case.state_dict.keys()
            assert all(np.array_equal(assumed.state_dict[k], v) for k, v in case.state_dict.items()), entry.name
            np.testing.assert_array_equal(assumed.x, case.x)
            assert assumed.code() == case.code()


def test_an_entry_run_on_an_assumed_case_gives_both_differences():
    case = CASES[0]
    swapped = catalogue.assume(case, ["gate_up_swapped"])
    both = convention("shared_experts_dropped").output(swapped)
    np.testing.assert_array_equal(both, catalogue.assume(case, ["gate_up_swapped", "shared_experts_dropped"]).expected())
    p = dict(case.params64)
    p["experts.w1"], p["experts.w3"] = p["experts.w3"], p["experts.w1"]
    p["shared_experts.down_proj.weight"] = np.zeros_like(p["shared_experts.down_proj.weight"])
    by_hand = np.asarray(refimpl.stable_latent_moe(case.x64, p, case.config))
    np.testing.assert_array_equal(both, by_hand)
    # An entry that is not a change of the config or weights still runs on an assumed case, on its values.
    for entry in CATALOGUE:
        if entry.applies(swapped):
            assert entry.output(swapped).shape == case.x.shape, entry.name


def test_only_changes_of_the_config_or_weights_can_be_assumed():
    assert {"gate_up_swapped", "shared_experts_dropped", "scale_applied_twice", "bias_subtracted"} <= {
        entry.name for entry in _composable()}
    for name in ("bias_in_weights", "experts_summed_in_bfloat16", "groups_masked_with_zero"):
        assert not convention(name).composable
        with pytest.raises(ValueError, match=f"{name} cannot be assumed"):
            catalogue.assume(CASES[0], [name])
    with pytest.raises(ValueError, match="no catalogued convention"):
        catalogue.assume(CASES[0], ["nope"])
