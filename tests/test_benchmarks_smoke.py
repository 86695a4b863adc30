"""The benchmark scripts still run, at tiny sizes, and what they print and write makes sense.

These are not timed tests: nothing here judges speed. Each script runs as a
user would start it (a subprocess, `--smoke`, results written to a temporary
folder), and the checks are about meaning: the FLOP count agrees with the
parameter accounting, the stage shares add up, every agreement check inside
the scripts passed, and the numbers are finite and positive. `benchmarks/gpu.py`
runs with `--cpu`, so the GPU script cannot rot on machines without a GPU.
PyTorch is optional: the comparison script is checked with it hidden, and
also with it when it happens to be installed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_script

from refimpl.config import MoEConfig
from refimpl.layer.accounting import parameter_counts

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
ROOT = REPO
HAS_TORCH = importlib.util.find_spec("torch") is not None


def run_script(args: list[str], *, hide: tuple[str, ...] = (), timeout: float = 300,
               returncode: int = 0) -> subprocess.CompletedProcess:
    """Run a benchmark script from the repository root, as if the modules in `hide` were not installed."""
    if hide:
        script, rest = args[0], args[1:]
        code = (f"import runpy, sys; sys.modules.update(dict.fromkeys({list(hide)!r})); "
                f"sys.path.insert(0, {str(BENCH)!r}); sys.argv = {[script, *rest]!r}; "
                f"sys.exit(runpy.run_path({script!r}, run_name='__main__').get('exit_code'))")
        cmd = [sys.executable, "-c", code]
    else:
        cmd = [sys.executable, *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == returncode, f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def load_common():
    sys.path.insert(0, str(BENCH))
    try:
        import common
    finally:
        sys.path.remove(str(BENCH))
    return common


def positive_finite(value: float) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


# ---------------------------------------------------------------------------
# The shared helpers
# ---------------------------------------------------------------------------

def test_timing_statistics_match_hand_computation():
    common = load_common()
    t = common.Timing("x", [4.0, 1.0, 3.0, 2.0, 100.0])
    assert t.median == 3.0 and t.best == 1.0 and t.worst == 100.0
    # Inclusive quartiles of 1, 2, 3, 4, 100 are 2 and 4: spread (4 - 2) / 3.
    assert t.spread == pytest.approx(2.0 / 3.0)
    calls = []
    timed = common.time_call("count", lambda: calls.append(1), repeats=3, warmup=2)
    assert len(calls) == 5 and len(timed.runs) == 3
    with pytest.raises(ValueError, match="repeats"):
        common.time_call("none", lambda: None, repeats=0)


def test_round_robin_takes_turns():
    common = load_common()
    order: list[str] = []
    timings = common.time_round_robin({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                                      repeats=2, warmup=1)
    assert order == ["a", "b"] * 3
    assert [len(t.runs) for t in timings.values()] == [2, 2]


def test_forward_flops_agree_with_the_parameter_accounting():
    common = load_common()
    for config in (MoEConfig.small(), MoEConfig.k3(), MoEConfig.tiny()):
        m = 37
        flops = common.forward_flops(config, m)
        # Two FLOPs per multiply-add, one multiply-add per activated weight and token.
        assert sum(flops.values()) == 2 * m * parameter_counts(config)["activated_with_router"]


def test_results_files(tmp_path):
    common = load_common()
    table = common.markdown_table(["name", "time"], [["a|b", "1.5 ms"], ["c", "2.0 ms"]])
    assert table.splitlines()[1] == "|---|---:|"
    assert "a\\|b" in table
    results = {"machine": {"date": "2026-01-01 00:00 UTC", "cpu": "test"}, "command": "python x.py",
               "timing": common.Timing("t", [1.0, 2.0])}
    paths = common.write_results("demo", "Demo", results, [("Table", table)], tmp_path, notes=["A note."])
    assert [p.name for p in paths] == ["demo.json", "demo.md"]
    data = json.loads((tmp_path / "demo.json").read_text())
    assert data["timing"]["median_s"] == 1.5
    page = (tmp_path / "demo.md").read_text()
    assert "2026-01-01" in page and "A note." in page and "## Table" in page
    assert common.write_results("demo", "Demo", results, [], None) == []


# ---------------------------------------------------------------------------
# The scripts
# ---------------------------------------------------------------------------

def test_bench_forward_smoke(tmp_path):
    proc = run_script(["benchmarks/bench_forward.py", "--smoke", "--out", str(tmp_path)])
    assert "effective" in proc.stdout
    data = json.loads((tmp_path / "forward.json").read_text())
    c = data["config"]
    config = MoEConfig.small(hidden_size=c["d"], latent_size=c["l"], num_experts=c["n"], top_k=c["k"],
                             intermediate_size=c["f"], num_shared_experts=c["shared"] // c["f"])
    assert sum(data["flops"].values()) == 2 * c["m"] * parameter_counts(config)["activated_with_router"]
    assert positive_finite(data["forward"]["median_s"])
    assert positive_finite(data["effective_gflops_median"])
    assert positive_finite(data["gemm_peak_gflops"])
    assert data["effective_gflops_median"] == pytest.approx(
        sum(data["flops"].values()) / data["forward"]["median_s"] / 1e9)
    assert set(data["stages"]) >= {"router", "routed_experts", "shared_experts"}
    assert all(positive_finite(s["median_s"]) for s in data["stages"].values())
    assert "forward.md" in {p.name for p in tmp_path.iterdir()}


def test_bench_forward_smoke_writes_nothing_by_default():
    before = sorted((REPO / "docs" / "benchmarks").glob("*")) if (REPO / "docs" / "benchmarks").exists() else []
    before_times = [p.stat().st_mtime for p in before]
    run_script(["benchmarks/bench_forward.py", "--smoke"])
    after = sorted((REPO / "docs" / "benchmarks").glob("*")) if (REPO / "docs" / "benchmarks").exists() else []
    assert after == before and [p.stat().st_mtime for p in after] == before_times


def check_torch_compare(data: dict, with_torch: bool) -> None:
    fwd = data["forward"]
    assert positive_finite(fwd["timings"]["numpy"]["median_s"])
    bal = data["balancing"]
    if "skipped" not in bal:
        assert positive_finite(bal["timings"]["numpy"]["median_s"])
    if not with_torch:
        assert set(fwd["timings"]) == {"numpy"}
        assert data["machine"]["torch"] == "not installed"
        return
    assert positive_finite(fwd["timings"]["torch_grouped"]["median_s"])
    # Both PyTorch versions compute the same layer as NumPy, to float32 rounding.
    assert fwd["torch_grouped_rel_error"] < 1e-5
    assert fwd["torch_per_token_rel_error"] < 1e-5
    assert fwd["per_token_extrapolated_s"] == pytest.approx(
        fwd["per_token_subset_s"] * fwd["m"] / fwd["per_token_subset"])
    if "skipped" not in bal:
        # The topk formulation gives the same bias as the project's update.
        assert bal["max_abs_difference"] <= 1e-6 * max(1.0, bal["bias_range"])


def test_torch_compare_smoke_without_torch(tmp_path):
    proc = run_script(["benchmarks/torch_compare.py", "--smoke", "--out", str(tmp_path)], hide=("torch",))
    assert "PyTorch is not installed" in proc.stdout
    check_torch_compare(json.loads((tmp_path / "torch_compare.json").read_text()), with_torch=False)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="PyTorch (the optional bench extra) is not installed")
def test_torch_compare_smoke_with_torch(tmp_path):
    proc = run_script(["benchmarks/torch_compare.py", "--smoke", "--out", str(tmp_path)])
    assert "time ratio NumPy / PyTorch grouped" in proc.stdout
    check_torch_compare(json.loads((tmp_path / "torch_compare.json").read_text()), with_torch=True)


@pytest.mark.slow
def test_gpu_script_on_the_cpu(tmp_path):
    pytest_args = "tests/test_xp.py -q -k 'bincount and numpy' -p no:cacheprovider"
    proc = run_script(["benchmarks/gpu.py", "--cpu", "--smoke", "--pytest-args", pytest_args,
                       "--out", str(tmp_path)])
    assert "all checks passed" in proc.stdout
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["failed"] == [] and data["cpu"] is True
    assert data["tests"]["ok"] and data["tests"]["counts"]["passed"] > 0
    fwd = data["forward"]
    assert positive_finite(fwd["timing"]["median_s"]) and positive_finite(fwd["gflops"])
    assert fwd["rel_error_vs_numpy"] <= 1e-4 and fwd["stages_vs_whole"] <= 1e-6
    bal = data["balancing"]
    if "skipped" not in bal:
        assert bal["histogram_max_error"] <= 2 * bal["bin_width"]
        assert positive_finite(bal["exact"]["median_s"]) and positive_finite(bal["histogram"]["median_s"])
    k3 = data["k3"]
    assert k3["rel_error_vs_float64"] <= k3["tolerance"]
    assert k3["weight_bytes"] > 0 and positive_finite(k3["achieved_bandwidth"])
    assert k3["achieved_bandwidth"] == pytest.approx(k3["weight_bytes"] / k3["timing"]["median_s"])
    # Every stage of Eq. (11) is timed, and the FLOPs are attributed to the stages that do them.
    stages = k3["stages"]
    assert list(stages) == ["router", "route (top-k, weights)", "down_projection", "routed_experts", "rms_norm",
                            "up_projection", "shared_experts", "output sum"]
    assert all(positive_finite(s["timing"]["median_s"]) for s in stages.values())
    # The host's time to issue a stage is part of the stage's time, run by run.
    assert all(0 < i <= t for s in stages.values()
               for i, t in zip(s["issued"]["runs_s"], s["timing"]["runs_s"], strict=True))
    assert sum(s["flops"] for s in stages.values()) == pytest.approx(k3["gflops"] * 1e9 * k3["timing"]["median_s"])
    assert positive_finite(k3["gemm_flops"])
    assert positive_finite(k3["stage_by_stage"]["median_s"])
    # One expert's turn: its pieces, on its average share of the tokens, mk/n, and the experts that were used.
    pieces = k3["expert_pieces"]
    assert pieces["tokens_per_expert"] == round(k3["m"] * 4 / 16)  # the smoke layer's k = 4, n = 16
    assert list(pieces["pieces"]) == ["cast 3 matrices to float32", "gather latents", "gate and up products",
                                      "SiTU-GLU", "weighted down product"]
    assert all(positive_finite(t["device_s"]) and positive_finite(t["host_s"]) for t in pieces["pieces"].values())
    assert pieces["device_s"] == pytest.approx(sum(t["device_s"] for t in pieces["pieces"].values()))
    assert 1 <= k3["active_experts"] <= 16
    assert "gpu.md" in {p.name for p in tmp_path.iterdir()}


def test_gpu_script_without_a_gpu_says_so_and_measures_nothing(tmp_path):
    # `make bench` runs every script: without CuPy the GPU check is skipped, unless a GPU is required.
    proc = run_script(["benchmarks/gpu.py", "--out", str(tmp_path)], hide=("cupy",))
    assert "GPU check skipped" in proc.stdout and "CuPy" in proc.stdout
    assert list(tmp_path.iterdir()) == []
    proc = run_script(["benchmarks/gpu.py", "--require-gpu", "--out", str(tmp_path)], hide=("cupy",),
                      returncode=1)
    assert "GPU check failed" in proc.stderr and "CuPy" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_gpu_script_fails_when_the_tests_do_not_pass(tmp_path):
    # The pytest step must not count a run with nothing passed as a success.
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--cpu", "--smoke", "--skip", "forward",
                           "--skip", "balancing", "--skip", "k3", "--pytest-args",
                           "tests/test_xp.py -q -k no_test_has_this_name", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "FAILED: tests" in proc.stdout


def load_gpu_script():
    """benchmarks/gpu.py as a module, for the checks that need its functions rather than its output."""
    sys.path.insert(0, str(BENCH))
    try:
        module = load_script(BENCH / "gpu.py", "gpu_check")
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_gpu_script_memory_estimate_of_the_k3_layer():
    gpu = load_gpu_script()
    k3 = MoEConfig.k3()
    need = gpu.k3_memory_needed(k3, 4096)
    # Every parameter of the layer in float16, from the accounting: 59.6 GB, the "about 59 GB".
    assert need["weights"] == 2 * parameter_counts(k3)["total"]
    assert 59e9 < need["weights"] < 60e9
    # The float32 work of 4096 tokens is a few GB: the layer fits an 80 GB device and an H200 easily.
    assert 1e9 < need["work"] < 6e9
    assert need["total"] == need["weights"] + need["work"] < 0.95 * 80e9


def test_gpu_script_skips_the_k3_layer_on_a_device_too_small(capsys):
    gpu = load_gpu_script()
    backend = gpu.Backend(cpu=True)
    backend.free_memory = lambda: 10**5  # a device with 100 kB free; this layer needs about 340 kB
    config = MoEConfig.k3().replace(hidden_size=64, latent_size=32, num_experts=16, top_k=4,
                                    intermediate_size=24, num_shared_experts=2)
    result = gpu.step_k3(backend, config, 64, sample=2, repeats=1, copy_bytes=1 << 20, gemm_size=32)
    assert result["ok"] and "needs about" in result["skipped"] and "free" in result["skipped"]
    assert result["memory_needed"]["total"] > 10**5
    assert "timing" not in result  # nothing was made or run
    assert "skipped: the layer needs about" in capsys.readouterr().out


def test_gpu_script_records_a_broken_step_and_runs_the_others(tmp_path, monkeypatch):
    gpu = load_gpu_script()

    def broken(*args, **kwargs):
        raise RuntimeError("out of device memory (simulated)")

    monkeypatch.setattr(gpu, "step_balancing", broken)
    monkeypatch.syspath_prepend(str(BENCH))
    code = gpu.main(["--cpu", "--smoke", "--skip", "tests", "--out", str(tmp_path)])
    assert code == 1
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["failed"] == ["balancing"]
    assert data["balancing"]["error"] == "RuntimeError: out of device memory (simulated)"
    assert data["forward"]["ok"] and data["k3"]["ok"]  # the steps before and after still ran
    page = (tmp_path / "gpu.md").read_text()
    assert "out of device memory (simulated)" in page and "FAILED" in page


# ---------------------------------------------------------------------------
# Moved here from the test files of the modules they measure
# ---------------------------------------------------------------------------


def test_bench_train_smoke_writes_its_log(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/bench_train.py", "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    written = json.loads((tmp_path / "train.json").read_text())
    assert all(run["tokens_per_second"] > 0 for run in written["runs"].values())
    assert "tokens/s" in (tmp_path / "train.md").read_text()


@pytest.mark.slow
def test_bench_histogram_smoke_writes_its_table(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "benchmarks/bench_histogram.py", "--smoke", "--out", str(tmp_path)],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "histogram pass" in proc.stdout and "peak resident memory" in proc.stdout
    assert {p.name for p in tmp_path.iterdir()} == {"histogram.json", "histogram.md"}


def test_gpu_script_padded_step_on_the_cpu(tmp_path):
    import json

    args = ["--cpu", "--smoke", "--skip", "tests", "--skip", "forward", "--skip", "balancing", "--skip", "k3",
            "--out", str(tmp_path)]
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    padded = json.loads((tmp_path / "gpu.json").read_text())["padded"]
    assert padded["ok"] and padded["dtype"] == "float32"
    cases = padded["cases"]
    assert set(cases) == {"zero bias", "Quantile Balancing"}
    for case in cases.values():
        assert case["waste"] == pytest.approx(case["max_over_mean"] - 1.0)
        assert case["padded_vs_grouped"] <= padded["tolerance"]
        assert case["padded"]["median_s"] > 0 and case["grouped"]["median_s"] > 0
    # The skewed router is unbalanced at zero bias; a Quantile Balancing bias from an earlier batch helps.
    assert cases["zero bias"]["max_over_mean"] > cases["Quantile Balancing"]["max_over_mean"]
    assert "padded batched product" in (tmp_path / "gpu.md").read_text()


def test_benchmark_smoke_writes_the_step_table(tmp_path):
    import json

    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_expert_parallel.py"), "--smoke",
                             "--ranks", "2", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                            timeout=200)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "expert_parallel.json").read_text())
    run = data["runs"]["2"]
    assert run["ranks"] == 2
    assert [row["case"] for row in run["rows"]] == ["zero bias", "sign rule", "Quantile Balancing"]
    for row in run["rows"]:
        assert row["step_ms"] > 0 and len(row["expert_ms"]) == 2 and len(row["rank_loads"]) == 2
        # The ranks' loads add up to every slot of the batch: 128 tokens per rank, k = 4.
        assert sum(row["rank_loads"]) == 2 * 128 * 4
        assert row["rank_max_over_mean"] == pytest.approx(max(row["rank_loads"]) / (sum(row["rank_loads"]) / 2))
    assert "ep_forward step by number of ranks" in (tmp_path / "expert_parallel.md").read_text()


def test_bench_checkpoint_smoke(tmp_path):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "benchmarks/bench_checkpoint.py", "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / "checkpoint.json").read_text())
    assert results["smoke"] is True and results["target"] == "not judged (smoke sizes)"
    assert set(results["precision"]) == {"routed experts in bfloat16", "routed experts in MXFP4",
                                         "MXFP4 weights, MXFP8 expert inputs",
                                         "MXFP8 inputs alone (against MXFP4 weights in float32)"}
    # The bf16 experts are far closer to float32 than MXFP4 ones: 8 significant bits against 2.
    assert results["precision"]["routed experts in bfloat16"]["u"] < results["precision"]["routed experts in MXFP4"]["u"]
    assert "## Memory" in (tmp_path / "checkpoint.md").read_text()


def test_bench_backward_smoke_checks_the_gradients(tmp_path):
    """`bench_backward.py --smoke` runs, checks PyTorch's gradients against ours and writes its two files."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "benchmarks/bench_backward.py", "--smoke", "--out", str(tmp_path)],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / "backward.json").read_text())
    assert (tmp_path / "backward.md").read_text().startswith("# Forward + backward")
    # float32 gradients of the two computations agree to float32 rounding.
    assert results["careful_rel_error"] < 1e-4 and results["naive_rel_error"] < 1e-4
    assert set(results["timings"]) == {"refimpl_forward", "refimpl_step", "refimpl_step_out", "torch_careful",
                                       "torch_naive"}
    assert all(t["median_s"] > 0 for t in results["timings"].values())
    assert results["flops_step"] == 3 * results["flops_forward"]


def test_profile_smoke():
    """`profile_backward.py --smoke` runs every stage it times and names each in its report."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "benchmarks/profile_backward.py", "--smoke"], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for stage in ("whole: forward", "whole: backward", "readable loop", "fast path",
                  "bwd 8: shared_experts_backward", "results from the pool (as shipped)",
                  "products' results new arrays", "first expert's each time (in cache)",
                  "bwd dz: a_bar G_e"):
        assert stage in proc.stdout, stage
