"""Trust, third round: what a careless user or an attacker tries, refused by name or answered right.

Each family is closed by one design decision, tested here on the cases that found it:
* a decimal in a record is reproduced to the record's own last digit (`records.decimals_agree`), so a fresh
  run that prints fewer digits cannot pass a stale record;
* the local docs server serves only regular files whose real path lies inside its folder, lists nothing, and
  answers every request;
* switches are real booleans and seeds real integers, everywhere in the public API (`refimpl._lib.values`);
* every router validates its scaling factor with one function;
* a dtype cast of weights is checked for overflow in one place, and a dtype is checked where it is taken;
* numbers at the edges (value ranges, big-endian arrays, a zero step) are refused or computed, never a raw
  error from below;
* files and command lines: a link in a checkpoint folder, an edited balancer file, a held folder.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import ServedSite
from records import ROUNDING, decimals_agree, masked, outputs_of, read_record, same_by_meaning

from refimpl import (
    MoEConfig,
    QuantileBalancer,
    init_params,
    quantile_balancing_update,
    route,
    stable_latent_moe,
)
from refimpl.balancing import Balancer, histogram_balancing_update, subgradient_check
from refimpl.checkpoints.state_dict import hf_state_dict_from_params, params_from_hf_state_dict
from refimpl.layer.baselines import hash_route, route_by_hash, route_by_table
from refimpl.layer.routing import mixture_weights
from refimpl.mx import mxfp4_decode, mxfp4_encode, mxfp8_round
from refimpl.train import main, read_checkpoint

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------
# The records comparator: the tolerance is the record's own last digit
# ---------------------------------------------------------------------------

@pytest.mark.parametrize(("recorded", "fresh"), [
    ("1e-12", "1e-11"), ("1e-11", "1e-12"),
    ("0.001", "0.01"), ("0.01", "0.001"),
    ("0.02", "1"), ("1", "0.02"),
    ("0.02", "0.1"),  # the fresh run prints one digit fewer: its unit gives no tolerance
    ("2.716", "2.7"), ("4.3e-10", "4e-10"),
    ("2.716", "2.7175"), ("0.5", "0.56"),
])
def test_a_decimal_printed_with_fewer_or_other_digits_does_not_pass_a_stale_record(recorded, fresh):
    assert not decimals_agree(recorded, fresh)
    assert same_by_meaning(f"error {recorded} at step 3", f"error {fresh} at step 3", "") != []


@pytest.mark.parametrize(("recorded", "fresh"), [
    ("2.716", "2.717"), ("2.716", "2.715"),  # a value on a rounding boundary prints either neighbour
    ("9.99", "10.00"), ("1.0e-11", "1.1e-11"), ("4.3e-10", "4.4e-10"),
    ("0.1", "0.10000000000000002"),  # the same number printed with all its digits
    ("2.716", "2.7165"), ("2.716", "2.71649"),  # more digits of a value that rounds to the record's
    ("1,048.5", "1,048.6"), ("-0.000", "0.000"),
])
def test_genuine_rounding_differences_agree(recorded, fresh):
    assert decimals_agree(recorded, fresh)
    assert same_by_meaning(f"error {recorded} at step 3", f"error {fresh} at step 3", "") == []


def test_an_examples_rounding_tolerance_still_widens_its_lines_only():
    line = "   largest relative difference: {}"
    assert same_by_meaning(line.format("6.4e-10"), line.format("8.6e-10"), "60_backward_by_hand") == []
    assert same_by_meaning(line.format("6.4e-10"), line.format("8.6e-10"), "") != []


# ---------------------------------------------------------------------------
# The local docs server serves only the regular files inside its folder, and answers every request
# ---------------------------------------------------------------------------

def small_site(folder: Path) -> Path:
    (folder / "assets").mkdir(parents=True)
    (folder / "page").mkdir()
    (folder / "bare").mkdir()  # a folder without index.html
    (folder / "bare" / "note.txt").write_text("inside", encoding="utf-8")
    (folder / "index.html").write_text("<p>home</p>", encoding="utf-8")
    (folder / "page" / "index.html").write_text("<p>a page</p>", encoding="utf-8")
    (folder / "assets" / "style.css").write_text("p {}", encoding="utf-8")
    (folder / "404.html").write_text("<p>not here</p>", encoding="utf-8")
    return folder


def raw_request(base: str, target: bytes) -> bytes:
    """The raw answer to `GET target`, sent byte for byte (no client library refuses or rewrites it)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    return answer


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1."), answer[:200]  # an HTTP answer, not a dropped connection
    return int(answer.split(b" ", 2)[1])


def test_links_out_of_the_site_are_not_followed(tmp_path):
    site = small_site(tmp_path / "site")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret", encoding="utf-8")
    (outside / "index.html").write_text("secret page", encoding="utf-8")
    (site / "leak.txt").symlink_to(outside / "secret.txt")
    (site / "leakdir").symlink_to(outside, target_is_directory=True)
    (site / "assets" / "up").symlink_to(tmp_path, target_is_directory=True)
    # A link that stays inside the site is a file of the site.
    (site / "alias.css").symlink_to(site / "assets" / "style.css")
    with ServedSite(site, "/refimpl/") as running:
        for path in ("/refimpl/leak.txt", "/refimpl/leakdir/secret.txt", "/refimpl/leakdir/", "/refimpl/leakdir",
                     "/refimpl/assets/up/outside/secret.txt", "/refimpl/assets/up/"):
            status, _, body = running.get(path)
            assert (status, body) == (404, b"<p>not here</p>"), path
        assert running.get("/refimpl/alias.css")[::2] == (200, b"p {}")


def test_a_404_page_that_leads_out_of_the_site_is_not_shown(tmp_path):
    site = small_site(tmp_path / "site")
    (tmp_path / "secret.html").write_text("secret", encoding="utf-8")
    (site / "404.html").unlink()
    (site / "404.html").symlink_to(tmp_path / "secret.html")
    with ServedSite(site, "/refimpl/") as running:
        status, _, body = running.get("/refimpl/missing")
        assert status == 404 and b"secret" not in body


def test_a_folder_without_index_html_is_not_listed(tmp_path):
    with ServedSite(small_site(tmp_path / "site"), "/refimpl/") as running:
        for path in ("/refimpl/bare/", "/refimpl/bare", "/refimpl/assets/", "/refimpl/assets"):
            status, _, body = running.get(path)
            assert (status, body) == (404, b"<p>not here</p>"), path
        assert running.get("/refimpl/bare/note.txt")[::2] == (200, b"inside")
        assert running.get("/refimpl/page")[::2] == (200, b"<p>a page</p>")  # a folder with its page: redirected


def test_what_is_not_a_regular_file_is_not_served(tmp_path):
    site = small_site(tmp_path / "site")
    os.mkfifo(site / "pipe.html")  # opening it for reading would wait for a writer
    (site / "null.html").symlink_to("/dev/null")
    with ServedSite(site, "/refimpl/") as running:
        for path in ("/refimpl/pipe.html", "/refimpl/null.html"):
            assert running.get(path)[0] == 404, path


@pytest.mark.parametrize(("target", "statuses"), [
    (b"/refimpl/%00", {400}),
    (b"/refimpl/index.html%00.css", {400}),
    (b"/refimpl/%ff%fe", {400}),  # not UTF-8 once decoded
    (b"/refimpl/%c0%ae%c0%ae/secret.txt", {400}),  # an overlong UTF-8 encoding of '..'
    (b"/refimpl/%zz", {404}),
    (b"/refimpl/" + b"a" * 5000, {404}),  # a name longer than the file system allows
    (b"/refimpl/" + b"a/" * 3000, {404}),  # a path longer than the file system allows
    (b"/refimpl/" + b"a" * 70000, {414}),  # longer than a request line may be
    (b"/refimpl/../../../../etc/passwd", {404}),
    (b"/refimpl/%2e%2e/%2e%2e/etc/passwd", {404}),
    (b"//etc/passwd", {404}),
    (b"/refimpl/page/index.html", {200}),
])
def test_every_request_gets_an_answer(tmp_path, target, statuses):
    with ServedSite(small_site(tmp_path / "site"), "/refimpl/") as running:
        answer = raw_request(running.base, target)
        assert status_of(answer) in statuses, answer[:300]
        assert b"root:" not in answer
        # and the server still serves after it
        assert running.get("/refimpl/")[:1] == (200,)


# ---------------------------------------------------------------------------
# Switches are real booleans, seeds real integers, everywhere
# ---------------------------------------------------------------------------

def small_batch():
    scores = np.random.default_rng(0).random((4, 6)).astype(np.float32)  # [m, n]
    return scores, np.zeros(6, np.float32), np.array([[0, 1], [2, 3], [4, 5]]), np.array([0, 1, 2, 0])


def switch_calls():
    """Every public function or class that takes a switch, called with the switch set to `value`."""
    from refimpl.balancing.quantile import cutoff_values, kth_largest
    from refimpl.layer.backward import route_backward, stable_latent_moe_vjp
    from refimpl.layer.latent_moe import routed_experts, shared_experts
    from refimpl.train.checkpoints import check_checkpoint_folder

    scores, bias, table, ids = small_batch()
    config = MoEConfig.tiny()
    params = init_params(config, 0)
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    index = np.array([[0, 1]] * 4)
    return {
        "route(renormalize)": lambda v: route(scores, bias, 2, renormalize=v),
        "route_by_hash(renormalize)": lambda v: route_by_hash(scores, ids, 2, renormalize=v),
        "route_by_table(renormalize)": lambda v: route_by_table(scores, ids, table, renormalize=v),
        "mixture_weights(renormalize)": lambda v: mixture_weights(scores[:, :2], renormalize=v),
        "route_backward(renormalize)": lambda v: route_backward(scores, index, scores[:, :2], renormalize=v,
                                                                scaling_factor=1.0),
        "quantile_balancing_update(center)": lambda v: quantile_balancing_update(scores, bias, 2, center=v),
        "quantile_balancing_update(leave_one_out)": lambda v: quantile_balancing_update(scores, bias, 2,
                                                                                        leave_one_out=v),
        "QuantileBalancer(leave_one_out)": lambda v: QuantileBalancer(6, 2, leave_one_out=v),
        "kth_largest(previous)": lambda v: kth_largest(scores, 2, previous=v),
        "kth_largest(overwrite)": lambda v: kth_largest(scores.copy(), 2, overwrite=v),
        "stable_latent_moe(return_intermediates)": lambda v: stable_latent_moe(x, params, config,
                                                                               return_intermediates=v),
        "stable_latent_moe(mxfp8_inputs)": lambda v: stable_latent_moe(x, params, config, mxfp8_inputs=v),
        "stable_latent_moe(save_for_backward)": lambda v: stable_latent_moe(x, params, config,
                                                                            save_for_backward=v),
        "stable_latent_moe_vjp(return_intermediates)": lambda v: stable_latent_moe_vjp(
            x, params, config, return_intermediates=v),
        "MoEConfig(renormalize)": lambda v: MoEConfig.tiny(renormalize=v),
        "MoEConfig(hash_routing)": lambda v: MoEConfig.tiny(hash_routing=v),
        "MoEConfig.to_hf_config(nested)": lambda v: config.to_hf_config(nested=v),
        "check_checkpoint_folder(overwrite)": lambda v: check_checkpoint_folder("/nonexistent-i45", overwrite=v),
        "cutoff_values(with_kth)": lambda v: cutoff_values(scores, bias, 2, with_kth=v),
        "routed_experts(save)": lambda v: routed_experts(
            x[:, :4], index[:3], scores[:3, :2], params["experts.w1"], params["experts.w3"], params["experts.w2"],
            config, save=v),
        "shared_experts(save)": lambda v: shared_experts(
            x, params["shared_experts.gate_proj.weight"], params["shared_experts.up_proj.weight"],
            params["shared_experts.down_proj.weight"], config, save=v),
    }


@pytest.mark.parametrize("call", sorted(switch_calls()))
@pytest.mark.parametrize("value", ["false", "true", "", 0, 1, None, 1.0, np.int64(0)], ids=repr)
def test_a_switch_is_a_real_boolean_or_refused_by_name(call, value):
    switch = call.split("(")[1].rstrip(")")
    with pytest.raises(TypeError, match=rf"{switch} must be True or False, got"):
        switch_calls()[call](value)


@pytest.mark.parametrize("call", sorted(switch_calls()))
def test_a_real_boolean_switch_is_taken_numpys_included(call):
    for value in (True, False, np.True_, np.False_):
        if call.startswith("stable_latent_moe(mxfp8_inputs)") and value:
            continue  # MXFP8 needs widths that are multiples of 32: the tiny layer's are not
        switch_calls()[call](value)


def test_renormalize_false_as_a_string_is_not_true():
    scores, bias, table, ids = small_batch()
    # The string is refused; the real False keeps the raw scores (no division by their sum).
    with pytest.raises(TypeError, match="renormalize must be True or False, got str 'false'"):
        route_by_table(scores, ids, table, renormalize="false")
    _, weights = route_by_table(scores, ids, table, renormalize=False)
    assert np.array_equal(weights, np.take_along_axis(scores, table[ids], axis=1))


@pytest.mark.parametrize("seed", [1.5, True, "7", None, np.float64(2.0), -1, 2**31])
def test_a_seed_is_an_integer_or_refused_by_name(seed):
    scores, _, _, ids = small_batch()
    with pytest.raises((TypeError, ValueError), match="seed must be an integer"):
        route_by_hash(scores, ids, 2, seed=seed)
    with pytest.raises((TypeError, ValueError), match="seed must be an integer"):
        hash_route(ids, 6, 2, seed=seed)


@pytest.mark.parametrize("rng", [1.5, True, "7", -1, np.float32(3)])
def test_init_params_takes_a_generator_an_integer_seed_or_none(rng):
    config = MoEConfig.tiny()
    with pytest.raises((TypeError, ValueError), match="rng must be"):
        init_params(config, rng)
    same = init_params(config, np.int64(3))["gate.weight"]
    assert np.array_equal(same, init_params(config, 3)["gate.weight"])
    assert np.array_equal(same, init_params(config, np.random.default_rng(3))["gate.weight"])
    assert np.array_equal(same, init_params(config, np.random.PCG64(3))["gate.weight"])
    assert np.array_equal(same, init_params(config, np.random.SeedSequence(3))["gate.weight"])


def test_study_workloads_take_integer_seeds_only():
    from refimpl.studies.workloads import skewed_batch, skewed_router

    with pytest.raises(TypeError, match="seed must be an integer, got float 1.5"):
        skewed_router(8, 4, 1.5)
    weight, mean = skewed_router(8, 4, 1)
    with pytest.raises(TypeError, match="step must be an integer, got bool True"):
        skewed_batch(weight, mean, 3, 1, True)


# ---------------------------------------------------------------------------
# One validation of the scaling factor for every router
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("factor", [math.nan, math.inf, -math.inf, -1, 0, 0.0, 10**400])
@pytest.mark.parametrize("router", ["route", "route_by_hash", "route_by_table", "mixture_weights"])
def test_every_router_refuses_the_scaling_factors_route_refuses(router, factor):
    scores, bias, table, ids = small_batch()
    calls = {"route": lambda: route(scores, bias, 2, scaling_factor=factor),
             "route_by_hash": lambda: route_by_hash(scores, ids, 2, scaling_factor=factor),
             "route_by_table": lambda: route_by_table(scores, ids, table, scaling_factor=factor),
             "mixture_weights": lambda: mixture_weights(scores[:, :2], scaling_factor=factor)}
    with pytest.raises(ValueError, match="scaling_factor must be positive and finite, got"):
        calls[router]()


@pytest.mark.parametrize("factor", ["2", True, None, 1j])
def test_a_scaling_factor_that_is_no_real_number_is_a_type_error(factor):
    scores, _, table, ids = small_batch()
    with pytest.raises(TypeError, match="scaling_factor must be a real number"):
        route_by_table(scores, ids, table, scaling_factor=factor)


def test_a_valid_scaling_factor_scales_every_router_alike():
    scores, bias, table, ids = small_batch()
    for factor in (2.5, np.float32(2.5), Fraction(5, 2), 2):
        _, plain = route_by_table(scores, ids, table)
        _, scaled = route_by_table(scores, ids, table, scaling_factor=factor)
        np.testing.assert_allclose(scaled, plain * float(factor), rtol=1e-6)
        _, plain = route_by_hash(scores, ids, 2)
        _, scaled = route_by_hash(scores, ids, 2, scaling_factor=factor)
        np.testing.assert_allclose(scaled, plain * float(factor), rtol=1e-6)


# ---------------------------------------------------------------------------
# dtype casts checked for overflow, dtypes checked where they are taken, tensors without values refused
# ---------------------------------------------------------------------------

def hf_block():
    config = MoEConfig.tiny()
    return config, hf_state_dict_from_params(init_params(config, 0, dtype=np.float64), config)


@pytest.mark.parametrize("name", ["gate.weight", "experts.1.w2.weight", "shared_experts.up_proj.weight"])
def test_a_float16_load_that_overflows_names_the_tensor(name):
    config, state = hf_block()
    state[name] = state[name].copy()
    state[name].flat[3] = 1e5  # finite, beyond float16's 65504
    with pytest.raises(ValueError, match=rf"tensor '{re.escape(name)}' holds 100000, beyond float16's largest"):
        params_from_hf_state_dict(state, config, dtype=np.float16)
    # float32 holds it: the same tensors load, and the value is kept.
    loaded = params_from_hf_state_dict(state, config, dtype=np.float32)
    assert np.float32(1e5) in np.asarray(loaded["gate.weight" if name == "gate.weight" else
                                                 "experts.w2" if "w2" in name else
                                                 "shared_experts.up_proj.weight"])


@pytest.mark.parametrize("dtype", ["banana", np.int32, "int8", bool, np.complex64, object, "f4,f4", [1, 2]],
                         ids=repr)
def test_a_dtype_that_is_not_floating_is_blamed_on_dtype(dtype):
    config, state = hf_block()
    pattern = r"^dtype must be a floating dtype \(float16, bfloat16, float32 or float64\), got"
    with pytest.raises(TypeError, match=pattern):
        params_from_hf_state_dict(state, config, dtype=dtype)
    with pytest.raises(TypeError, match=pattern):
        init_params(config, 0, dtype=dtype)


def test_every_floating_dtype_in_either_byte_order_is_taken():
    config, state = hf_block()
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64, ">f4", "<f8", "float32"):
        native = np.dtype(dtype).newbyteorder("=")
        assert params_from_hf_state_dict(state, config, dtype=dtype)["gate.weight"].dtype == native
        assert init_params(config, 0, dtype=dtype)["gate.weight"].dtype == native


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("kind", ["meta", "sparse_coo", "sparse_csr"])
def test_a_pytorch_tensor_without_readable_values_is_refused_by_name(kind):
    torch = pytest.importorskip("torch")
    config, state = hf_block()
    tensors = {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in state.items()}
    dense = tensors["gate.weight"]
    tensors["gate.weight"] = {"meta": lambda: torch.empty(dense.shape, device="meta"),
                              "sparse_coo": dense.to_sparse, "sparse_csr": dense.to_sparse_csr}[kind]()
    with pytest.raises(ValueError, match=r"tensor 'gate.weight' must be a dense tensor with values, got a "
                                         rf"PyTorch {kind.split('_')[0]}"):
        params_from_hf_state_dict(tensors, config)
    tensors["gate.weight"] = dense  # the positive control: dense tensors load
    params_from_hf_state_dict(tensors, config)


# ---------------------------------------------------------------------------
# Numbers at the edges
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("value_range", [(0, 1e-40), (-1e308, 1e308), (0, 1e308), (-1e39, 0),
                                         (0, 10**400), (-(10**400), 1), (1.0, 1.0 + 1e-12)], ids=repr)
def test_a_value_range_the_arithmetic_cannot_bin_is_refused_by_name(value_range):
    scores = np.random.default_rng(0).random((32, 4)).astype(np.float32)
    with pytest.raises(ValueError, match=r"^value_range must be"):
        histogram_balancing_update(scores, np.zeros(4, np.float32), 1, value_range=value_range)


def test_a_float64_bias_bins_a_range_float32_could_not():
    scores = np.random.default_rng(0).random((32, 4))
    # 1e39 is beyond float32 but inside float64, the arithmetic of a float64 bias.
    out = histogram_balancing_update(scores, np.zeros(4), 1, value_range=(-1e39, 1e39))
    assert np.all(np.isfinite(out))
    with pytest.raises(ValueError, match=r"value_range must be a range float32"):
        histogram_balancing_update(scores.astype(np.float32), np.zeros(4, np.float32), 1, value_range=(-1e39, 1e39))


@pytest.mark.parametrize("order", [">", "<"])
def test_the_mx_codecs_compute_arrays_of_either_byte_order(order):
    w = np.random.default_rng(1).standard_normal((3, 64))  # [rows, K]
    for dtype in ("f4", "f8", "f2"):
        native = w.astype(dtype)
        other = native.astype(order + dtype)
        packed, scale = mxfp4_encode(native)
        packed_other, scale_other = mxfp4_encode(other)
        assert np.array_equal(packed, packed_other) and np.array_equal(scale, scale_other)
        assert np.array_equal(mxfp8_round(native), mxfp8_round(other))
        decoded = mxfp4_decode(packed, scale, dtype=order + dtype)
        assert decoded.dtype == np.dtype(dtype) and np.array_equal(decoded, mxfp4_decode(packed, scale, dtype=dtype))


def test_the_layer_and_the_codecs_agree_on_a_big_endian_input():
    config = MoEConfig.tiny(latent_size=32, hidden_size=64, intermediate_size=32)
    params = init_params(config, 0)
    x = np.random.default_rng(2).standard_normal((5, 64)).astype(np.float32)  # [m, d]
    y = stable_latent_moe(x, params, config, mxfp8_inputs=True)
    assert np.array_equal(stable_latent_moe(x.astype(">f4"), params, config, mxfp8_inputs=True), y)


@pytest.mark.parametrize("step", [0, 0.0, -1e-6, math.nan, math.inf, 1e-300, "1e-6", None])
def test_a_finite_difference_step_that_measures_nothing_is_refused(step):
    scores = np.random.default_rng(0).random((16, 4))
    bias = np.array([0.1, -0.2, 0.3, -0.2])
    with pytest.raises((TypeError, ValueError), match=r"^step must"):
        subgradient_check(scores, bias, 2, step=step)
    assert subgradient_check(scores, bias, 2, step=1e-6).finite_difference.shape == (4,)


# ---------------------------------------------------------------------------
# Files and command lines
# ---------------------------------------------------------------------------

FLAGS = ["--d", "16", "--latent", "8", "--experts", "8", "--top-k", "2", "--intermediate", "8", "--layers", "2",
         "--context", "4", "--embed", "4", "--batch", "64", "--eval-every", "4", "--stats-every", "3", "--quiet",
         "--seed", "3", "--balancer", "qb"]


@pytest.mark.parametrize("target", ["folder", "file", "dangling"])
def test_a_link_named_like_a_checkpoint_neither_crashes_the_run_nor_is_followed(tmp_path, target):
    folder, out = tmp_path / "ck", tmp_path / "run.json"
    main([*FLAGS, "--steps", "2", "--checkpoint", str(folder)])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine", encoding="utf-8")
    link = folder / "step-00000001-0123abcd"
    partial = folder / ".latest.json.x.partial"
    if target == "folder":
        link.symlink_to(outside, target_is_directory=True)
        partial.symlink_to(outside / "keep.txt")
    elif target == "file":
        link.symlink_to(outside / "keep.txt")
    else:
        link.symlink_to(tmp_path / "nothing")
    main([*FLAGS, "--steps", "4", "--checkpoint", str(folder), "--resume", str(folder), "--out", str(out)])
    assert json.loads(out.read_text(encoding="utf-8"))["steps"][-1]["step"] == 4  # the log is written
    assert read_checkpoint(folder).step == 4
    assert link.is_symlink() and (outside / "keep.txt").read_text(encoding="utf-8") == "mine"
    assert target != "folder" or partial.is_symlink()
    # Of the real checkpoints, only the current one is left.
    assert [p.name for p in folder.iterdir() if p.is_dir() and not p.is_symlink()] == \
        [read_checkpoint(folder).folder.name]


def saved_balancer(tmp_path: Path, options) -> Path:
    """A saved Quantile Balancing state whose 'options' field is replaced by `options`, as an edit would."""
    path = tmp_path / "balancer.npz"
    balancer = QuantileBalancer(8, 2)
    balancer.step(np.random.default_rng(0).random((64, 8)).astype(np.float32))
    balancer.save(path)
    with np.load(path) as data:
        fields = {name: data[name] for name in data.files}
    fields["options"] = np.array(options if isinstance(options, str) else json.dumps(options))
    with open(path, "wb") as file:
        np.savez(file, **fields)
    return path


@pytest.mark.parametrize(("options", "pattern"), [
    ({"leave_one_out": False, "damping": 1.0, "turbo": True}, r"holds \['turbo'\], which are no options of it"),
    ({"rate": 0.1}, r"holds \['rate'\], which are no options of it: expected some of \['damping', 'leave_one_out'\]"),
    ([1, 2], r"must be a JSON object of option names and values, got \[1, 2\]"),
    ("3", r"must be a JSON object of option names and values, got 3"),
    ("null", r"must be a JSON object of option names and values, got None"),
    ({"leave_one_out": "false"}, r"describe no 'qb' balancer: leave_one_out must be True or False, got str"),
    ({"damping": -1}, r"describe no 'qb' balancer: damping must be positive and finite"),
])
def test_a_balancer_file_with_edited_options_is_refused_naming_file_and_field(tmp_path, options, pattern):
    path = saved_balancer(tmp_path, options)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: the field.* 'options'.*{pattern}"):
        Balancer.restore(path)


def test_a_balancer_file_with_an_edited_size_is_refused_naming_the_field(tmp_path):
    path = saved_balancer(tmp_path, {"leave_one_out": False, "damping": 1.0})
    assert Balancer.restore(path).options() == {"leave_one_out": False, "damping": 1.0}  # the control
    with np.load(path) as data:
        fields = {name: data[name] for name in data.files}
    fields["top_k"] = np.array("two")
    with open(path, "wb") as file:
        np.savez(file, **fields)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: the field 'top_k' must be one integer"):
        Balancer.restore(path)


def test_a_second_run_on_a_held_folder_prints_one_line_and_no_traceback(tmp_path):
    folder = tmp_path / "ck"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, refimpl.train.checkpoints as T\n"
                               f"with T.checkpoint_lock({str(folder)!r}):\n"
                               "    print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        run = subprocess.run([sys.executable, "-m", "refimpl.train", *FLAGS, "--steps", "2", "--checkpoint",
                              str(folder), "--out", str(tmp_path / "run.json")],
                             capture_output=True, text=True, cwd=ROOT, timeout=300)
    finally:
        holder.communicate("", timeout=60)
    assert run.returncode == 1
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith("python -m refimpl.train: error: checkpoint: another run is writing checkpoints "
                                 f"into {folder}")
    assert not (tmp_path / "run.json").exists() and list(folder.iterdir()) == []


@pytest.mark.parametrize("stem", sorted(ROUNDING))
def test_every_rounding_entry_names_lines_its_record_holds(stem):
    """An entry whose pattern matches no line of its record widens nothing now, but would widen a line
    added later, unreasoned: each must name lines the record prints."""
    record = read_record(ROOT / "examples" / f"{stem}.py")
    lines = [re.sub(" +", " ", line.strip()) for cell in record.cells if cell.cell_type == "code"
             for text in outputs_of(cell) for line in masked(text, stem).split("\n")]
    for pattern, tolerance, _ in ROUNDING[stem]:
        assert any(re.search(pattern, line) for line in lines), (stem, pattern)
        assert 0 < tolerance < 1, (stem, pattern)


@pytest.mark.parametrize("router", ["route", "route_by_hash", "route_by_table"])
def test_a_scaling_factor_that_overflows_the_weights_is_refused_not_infinite(router):
    scores, bias, table, ids = small_batch()  # float32 scores: weights in float32
    calls = {"route": lambda c: route(scores, bias, 2, scaling_factor=c),
             "route_by_hash": lambda c: route_by_hash(scores, ids, 2, scaling_factor=c),
             "route_by_table": lambda c: route_by_table(scores, ids, table, scaling_factor=c)}
    with pytest.raises(ValueError, match=r"scaling_factor must keep the weights within float32's range, got 1e\+300"):
        calls[router](1e300)
    _, weights = route_by_table(scores.astype(np.float64), ids, table, scaling_factor=1e300)
    assert np.all(np.isfinite(weights))  # float64 weights hold it
