"""Inputs the converters and the expert-parallel layer must refuse by name, or read as they are.

The state-dict converters (`refimpl.checkpoints.state_dict`) meet tensors of
every PyTorch dtype and layout, switches that come from JSON files, and
checkpoints written by other tools; the expert-parallel layer
(`refimpl.parallel.expert_parallel`) meets one rank's bad input while the
others wait in an exchange. Each test here holds one such input to a
readable error (or to the exact values), and the MPI test holds every rank
to the same error, under a timeout, so that a hang fails instead of
blocking the suite.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import run_mpiexec
from mpi4py import MPI

import refimpl
from refimpl.checkpoints import hf_hash_table, hf_state_dict_from_params, params_from_hf_state_dict
from refimpl.checkpoints.state_dict import as_numpy, hf_tensor_shapes
from refimpl.families import ALL_RECORDS
from refimpl.parallel import ep_forward, ep_vjp

ROOT = Path(__file__).resolve().parents[1]
MPI_TIMEOUT = 120


def _config(**changes) -> refimpl.MoEConfig:
    """A small K3 layer whose widths suit MXFP4 (multiples of 32)."""
    return refimpl.MoEConfig(hidden_size=64, latent_size=32, num_experts=4, top_k=2, intermediate_size=32,
                             num_shared_experts=1, num_moe_layers=1, **changes)


def _state_dict() -> tuple[refimpl.MoEConfig, dict[str, np.ndarray]]:
    config = _config()
    return config, hf_state_dict_from_params(refimpl.init_params(config, 0), config)


def _family(model_type: str) -> refimpl.MoEConfig:
    return refimpl.MoEConfig.from_hf_config(dict(ALL_RECORDS[model_type].test_keys, model_type=model_type))


# ---------------------------------------------------------------------------
# Reading: PyTorch dtypes and layouts
# ---------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", ["complex32", "bits8", "bits16", "float4_e2m1fn_x2"])
def test_torch_dtypes_numpy_cannot_hold_are_named(kind):
    config, sd = _state_dict()
    g = torch.from_numpy(sd["gate.weight"])
    value = {"complex32": lambda: g.to(torch.complex32),
             "bits8": lambda: g.to(torch.float8_e4m3fn).view(torch.bits8),
             "bits16": lambda: g.to(torch.bfloat16).view(torch.bits16),
             "float4_e2m1fn_x2": lambda: torch.zeros(g.shape, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}[kind]()
    with pytest.raises(TypeError, match=rf"tensor 'gate.weight' has the PyTorch dtype {kind}, which has no NumPy"):
        params_from_hf_state_dict({**sd, "gate.weight": value}, config)


@pytest.mark.parametrize("kind", ["float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_fnuz_float8_is_read_bit_for_bit_and_refused_as_a_weight_by_name(kind):
    values = torch.tensor([0.5, -1.0, 2.0, 0.0])
    read = as_numpy(values.to(getattr(torch, kind)), "w")
    assert read.dtype == np.dtype(getattr(ml_dtypes, kind))
    np.testing.assert_array_equal(read.astype(np.float32), values.numpy())
    config, sd = _state_dict()
    with pytest.raises(ValueError, match=rf"gate.weight: expected floating \[4, 64\], got {kind} \[4, 64\]"):
        params_from_hf_state_dict({**sd, "gate.weight": torch.from_numpy(sd["gate.weight"]).to(getattr(torch, kind))},
                                  config)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", ["nested", "quantized"])
def test_nested_and_quantized_tensors_are_refused_by_kind(kind):
    config, sd = _state_dict()
    g = torch.from_numpy(sd["gate.weight"])
    value = torch.nested.nested_tensor(list(g)) if kind == "nested" else torch.quantize_per_tensor(g, 0.1, 0, torch.qint8)
    with pytest.raises(ValueError, match=rf"tensor 'gate.weight' must be a dense tensor with values, got a PyTorch "
                                         rf"{kind} tensor"):
        params_from_hf_state_dict({**sd, "gate.weight": value}, config)


# ---------------------------------------------------------------------------
# Writing: PyTorch params, switches
# ---------------------------------------------------------------------------

def test_writer_reads_bfloat16_and_grad_tensors_as_the_reader_does():
    config = _config()
    params = refimpl.init_params(config, 0)
    bf16 = {name: torch.from_numpy(np.array(value)).to(torch.bfloat16) for name, value in params.items()}
    written = hf_state_dict_from_params(bf16, config)
    expected = hf_state_dict_from_params({name: as_numpy(t, name) for name, t in bf16.items()}, config)
    assert list(written) == list(expected)
    for name in expected:
        assert written[name].dtype == np.dtype(ml_dtypes.bfloat16), name
        np.testing.assert_array_equal(written[name].view(np.int16), expected[name].view(np.int16), err_msg=name)
    grad = {name: torch.from_numpy(np.array(value)).requires_grad_(True) for name, value in params.items()}
    written = hf_state_dict_from_params(grad, config)
    for name, value in hf_state_dict_from_params(params, config).items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)


def test_writer_refuses_meta_tensors_by_name():
    config = _config()
    meta = {name: torch.from_numpy(np.array(value)).to("meta") for name, value in refimpl.init_params(config, 0).items()}
    with pytest.raises(ValueError, match=r"tensor 'gate.weight' must be a dense tensor with values, got a PyTorch "
                                         r"meta tensor"):
        hf_state_dict_from_params(meta, config)


@pytest.mark.parametrize("value", ["False", 1, None, []])
def test_mxfp4_is_a_real_boolean(value):
    config = _config()
    params = refimpl.init_params(config, 0)
    with pytest.raises(TypeError, match="mxfp4 must be True or False"):
        hf_state_dict_from_params(params, config, mxfp4=value)
    with pytest.raises(TypeError, match="mxfp4 must be True or False"):
        hf_tensor_shapes(config, mxfp4=value)


# ---------------------------------------------------------------------------
# Reading: families' tables, optional tensors, names
# ---------------------------------------------------------------------------

def test_hash_tables_that_repeat_an_expert_in_a_row_are_refused_on_read():
    config = _family("deepseek_v4")
    params = dict(refimpl.init_params(config, 0))
    params["gate.e_score_correction_bias"][:] = 0
    sd = hf_state_dict_from_params(params, config, model_type="deepseek_v4", tid2eid=np.array([[0, 1], [2, 3]]))
    sd["gate.tid2eid"] = np.array([[0, 1], [2, 2]])  # row 1 names expert 2 twice
    with pytest.raises(ValueError, match=r"gate.tid2eid\[1\] = \[2, 2\] names an expert twice"):
        hf_hash_table(sd, config)
    with pytest.raises(ValueError, match=r"gate.tid2eid\[1\] = \[2, 2\] names an expert twice"):
        params_from_hf_state_dict(sd, config, model_type="deepseek_v4", hash_layer=True)


def test_nemotron_h_zero_width_shared_tensors_may_be_left_out():
    config = _family("nemotron_h").replace(num_shared_experts=0, shared_intermediate_size=None)
    params = dict(refimpl.init_params(config, 0))
    params["experts.w1"] = params["experts.w3"].copy()  # ungated experts: gate == up
    sd = hf_state_dict_from_params(params, config, model_type="nemotron_h")
    assert all(v.size == 0 for k, v in sd.items() if k.startswith("shared"))
    full = params_from_hf_state_dict(sd, config, model_type="nemotron_h")
    lean = params_from_hf_state_dict({k: v for k, v in sd.items() if not k.startswith("shared")}, config,
                                     model_type="nemotron_h")
    assert list(lean) == list(full)
    for name in full:
        np.testing.assert_array_equal(np.asarray(lean[name]), np.asarray(full[name]), err_msg=name)


def test_an_expert_id_with_a_leading_zero_is_listed_as_spelled():
    config = _family("deepseek_v3")
    sd = hf_state_dict_from_params(refimpl.init_params(config, 0), config, model_type="deepseek_v3",
                                   expert_layout="per_expert")
    sd["experts.01.gate_proj.weight"] = sd.pop("experts.1.gate_proj.weight")
    with pytest.raises(ValueError) as info:
        params_from_hf_state_dict(sd, config, model_type="deepseek_v3")
    text = str(info.value)
    assert "not in the block (1): experts.01.gate_proj.weight" in text
    assert "missing (1): experts.1.gate_proj.weight" in text


# ---------------------------------------------------------------------------
# Expert parallelism: one process
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["no", 1, None])
def test_ep_vjp_return_intermediates_is_a_real_boolean(value):
    config = _config()
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    with pytest.raises(TypeError, match="ep_vjp: rank 0 of 1: return_intermediates must be True or False"):
        ep_vjp(x, refimpl.init_params(config, 0), config, MPI.COMM_SELF, return_intermediates=value)


@pytest.mark.parametrize(("token_ids", "error", "message"), [
    (None, ValueError, r"token_ids must be given \(one integer id per token of x, shape \[5\]\)"),
    (np.arange(3), ValueError, r"token_ids must have shape \[5\] \(one id per token of x\), got \[3\]"),
    (np.arange(5.0), TypeError, r"token_ids must be an integer array of shape \[5\], got dtype float64"),
    (np.array([0, 1, 2, 3, -1]), ValueError, r"token_ids must hold integers in \[0, 4294967296\) for hash routing, "
                                             r"got values in \[-1, 3\]"),
])
def test_ep_token_ids_are_checked_by_name(token_ids, error, message):
    config = _config(hash_routing=True)
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    with pytest.raises(error, match=rf"ep_forward: rank 0 of 1: {message}"):
        ep_forward(x, refimpl.init_params(config, 0), config, MPI.COMM_SELF, token_ids=token_ids)


@pytest.mark.parametrize("hash_routing", [False, True])
@pytest.mark.parametrize(("token_ids", "error", "message"), [
    (np.arange(3), ValueError, r"token_ids must have shape \[5\] \(one id per token of x\), got \[3\]"),
    (np.arange(5.0), TypeError, r"token_ids must be an integer array of shape \[5\], got dtype float64"),
    ([0, 1, 2, 3, 4], TypeError, r"token_ids must be an integer array of shape \[5\], got list"),
])
def test_bad_token_ids_are_refused_alike_on_one_process_and_across_ranks(hash_routing, token_ids, error, message):
    """The one-process layer ignored malformed ids when hash routing was off, where ep_forward refused them."""
    config = _config(hash_routing=hash_routing)
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    params = refimpl.init_params(config, 0)
    with pytest.raises(error, match=message):
        refimpl.stable_latent_moe(x, params, config, token_ids=token_ids)
    with pytest.raises(error, match=rf"ep_forward: rank 0 of 1: {message}"):
        ep_forward(x, params, config, MPI.COMM_SELF, token_ids=token_ids)
    good = np.arange(5)  # well-formed ids: the same layer on both
    np.testing.assert_allclose(ep_forward(x, params, config, MPI.COMM_SELF, token_ids=good)[0],
                               refimpl.stable_latent_moe(x, params, config, token_ids=good), rtol=1e-5, atol=1e-6)


def test_ep_mixed_array_libraries_are_named():
    config = _config()
    with pytest.raises(TypeError, match=r"x and params must come from one array library: x is a torch Tensor, "
                                        r"but params\['gate.weight'\] is a numpy ndarray"):
        ep_forward(torch.zeros(5, 64), refimpl.init_params(config, 0), config, MPI.COMM_SELF)


# ---------------------------------------------------------------------------
# Expert parallelism: one rank's bad token ids, every rank ends with the error
# ---------------------------------------------------------------------------

_ONE_BAD_RANK = textwrap.dedent(r'''
    import sys
    import numpy as np, refimpl
    from mpi4py import MPI
    from refimpl.parallel import ep_forward, ep_vjp, shard_params
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    config = refimpl.MoEConfig(hidden_size=64, latent_size=32, num_experts=4, top_k=2, intermediate_size=32,
                               num_shared_experts=1, num_moe_layers=1, hash_routing=True)
    params = shard_params(refimpl.init_params(config, 0), config, rank, size)
    x = np.random.default_rng(rank).standard_normal((5, 64)).astype(np.float32)
    lines = []
    bad = {"short": np.arange(3), "float": np.arange(5.0), "negative": np.array([0, 1, 2, 3, -1]),
           "missing": None}
    for case, ids in bad.items():
        for name, f in (("ep_forward", ep_forward), ("ep_vjp", ep_vjp)):
            token_ids = ids if rank == size - 1 else np.arange(5)  # the last rank's ids are bad
            try:
                f(x, params, config, comm, token_ids=token_ids)
                lines.append(f"rank {rank} {case} {name}: returned")
            except Exception as e:
                lines.append(f"rank {rank} {case} {name}: {type(e).__name__}: {e}")
    # One rank's scores underflow to 0 (sqrt-softplus of very negative products): the hash-routed weights
    # 0/0 are refused on that rank, from its own data, after the router product.
    config = config.replace(score_function="sqrtsoftplus")
    params = dict(params, **{"gate.weight": np.full((4, 64), 0.1, np.float32)})
    x_last = np.full((5, 64), -1e4, np.float32) if rank == size - 1 else x
    for name, f in (("ep_forward", ep_forward), ("ep_vjp", ep_vjp)):
        try:
            f(x_last, params, config, comm, token_ids=np.arange(5))
            lines.append(f"rank {rank} underflow {name}: returned")
        except Exception as e:
            lines.append(f"rank {rank} underflow {name}: {type(e).__name__}: {e}")
    with open(f"{sys.argv[1]}/rank{rank}.txt", "w") as out:  # one file per rank: printed lines interleave
        out.write("\n".join(lines) + "\n")
''')


def test_one_ranks_bad_token_ids_end_every_rank_with_the_error(tmp_path: Path):
    script = tmp_path / "one_bad_rank.py"
    script.write_text(_ONE_BAD_RANK)
    # The ranks import this checkout's refimpl (not whatever an installed copy points to); a rank that hangs
    # in an exchange makes the job pass MPI_TIMEOUT, and run_mpiexec fails the test with what it printed.
    result = run_mpiexec(["-n", "2", sys.executable, "-m", "mpi4py", str(script), str(tmp_path)],
                         timeout=MPI_TIMEOUT, env={"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for rank in (0, 1) for line in (tmp_path / f"rank{rank}.txt").read_text().splitlines()]
    for case in ("short", "float", "negative", "missing", "underflow"):
        for name in ("ep_forward", "ep_vjp"):
            for rank in (0, 1):
                [line] = [line for line in lines if line.startswith(f"rank {rank} {case} {name}:")]
                what = "scores of the chosen experts" if case == "underflow" else "token_ids"
                assert f"ValueError: {name}: rank 1 of 2: {what}" in line or (
                    case == "float" and f"TypeError: {name}: rank 1 of 2: {what}" in line), line
