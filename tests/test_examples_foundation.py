"""The foundation's worked examples run, and what they print is true.

Each example is imported and its `main` called with `--out` into a temporary
folder; the printed text is then checked line by line against values computed
here independently (closed forms, `math`, the numbers K3's report states), and the
figures are checked to be PNG files. One slow test also runs each script as
`python examples/NN_slug.py`, the way the docs build does.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import load_example

from refimpl.layer.latent_moe import stable_latent_moe_reference

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(stem: str, tmp_path: Path, capsys) -> tuple[str, dict, Path]:
    out = tmp_path / stem
    result = load_example(stem).main(["--out", str(out)])
    return capsys.readouterr().out, result, out


def number_after(text: str, label: str) -> str:
    """The first number printed after `label` on its line."""
    line = next(line for line in text.splitlines() if label in line)
    match = re.search(r"[-+]?[\d,]*\.?\d+(?:e[-+]?\d+)?", line.split(label, 1)[1])
    assert match, line
    return match.group(0)


def row_value(text: str, label: str) -> str:
    """The last column of the table row whose first column is `label`."""
    pattern = re.compile(rf"^\s*{re.escape(label)}(\s{{2,}}|$)")
    line = next(line for line in text.splitlines() if pattern.match(line))
    return line.split()[-1]


def assert_pngs(folder: Path, names: list[str]) -> None:
    for name in names:
        data = (folder / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name


# ---------------------------------------------------------------------------
# 01: one forward pass by hand
# ---------------------------------------------------------------------------

def test_forward_by_hand(tmp_path, capsys):
    text, r, out = run("01_forward_by_hand", tmp_path, capsys)
    config, params, x = r["config"], r["params"], r["x"]
    assert (x.shape, config.d, config.ell, config.n, config.k, config.f) == ((4, 8), 8, 4, 6, 2, 6)
    # Every stage is printed with its shape.
    for header in ("x  [4, 8]", "s  [4, 6]", "s + b  [4, 6]", "index  [4, 2]", "weights  [4, 2]",
                   "z  [4, 4]", "u  [4, 4]", "v = u / rms(u) * g  [4, 4]", "y_routed = v W_up^T  [4, 8]",
                   "y = y_shared + y_routed  [4, 8]"):
        assert header in text, header

    # The hand computation equals the package's per-token reference.
    np.testing.assert_allclose(r["y"], stable_latent_moe_reference(x, params, config), rtol=1e-12, atol=1e-14)
    assert float(number_after(text, "max |y_by_hand - stable_latent_moe(x)|")) < 1e-12
    assert float(number_after(text, "max |y_by_hand - stable_latent_moe_reference(x)|")) < 1e-12

    # The routing decisions, recomputed with Python's sort.
    s = 1.0 / (1.0 + np.exp(-(x @ params["gate.weight"].T)))
    b = params["gate.e_score_correction_bias"].astype(np.float64)
    ranked = [sorted(range(6), key=lambda j, i=i: (-(s[i, j] + b[j]), j)) for i in range(4)]
    raw = [sorted(range(6), key=lambda j, i=i: (-s[i, j], j)) for i in range(4)]
    chosen_lines = re.findall(r"^ +e(\d): s \+ b = .*chosen$", text, flags=re.M)
    assert [int(j) for j in chosen_lines] == [j for row in ranked for j in row[:2]]
    np.testing.assert_array_equal(r["index"], [row[:2] for row in ranked])
    changed = [i for i in range(4) if set(ranked[i][:2]) != set(raw[i][:2])]
    assert f"tokens whose choice the bias changed: {changed}" in text
    assert len(changed) >= 1 and text.count("the bias changed this choice") == len(changed)
    # Weights are the raw scores of the chosen experts, renormalized: each row sums to 1.
    expected_w = np.array([[s[i, j] for j in row[:2]] for i, row in enumerate(ranked)])
    np.testing.assert_allclose(r["weights"], expected_w / expected_w.sum(axis=1, keepdims=True), rtol=1e-12)
    assert text.count("they sum to 1.000") == 4
    load = Counter(j for row in ranked for j in row[:2])
    assert f"tokens per expert: {[load[j] for j in range(6)]}" in text
    idle = [j for j in range(6) if load[j] == 0]
    assert f"experts with no token: {idle}" in text and idle
    assert text.count("(no token: this expert does no work in this batch)") == len(idle)

    # The norm brings every token's routed sum to root mean square sqrt(ms / (ms + eps)), about 1.
    ms_u = np.mean(r["u"] ** 2, axis=1)
    rms_v = np.sqrt(np.mean(r["v"] ** 2, axis=1))
    np.testing.assert_allclose(rms_v, np.sqrt(ms_u / (ms_u + config.rms_norm_eps)), rtol=1e-12)
    assert f"of v: {rms_v.min():.3f} .. {rms_v.max():.3f}" in text and rms_v.min() > 0.99
    assert f"a factor {np.sqrt(ms_u.max() / ms_u.min()):.1f}" in text
    assert_pngs(out, ["routing.png"])


# ---------------------------------------------------------------------------
# 02: the K3 accounting table
# ---------------------------------------------------------------------------

def test_k3_accounting(tmp_path, capsys):
    text, _, out = run("02_k3_accounting", tmp_path, capsys)
    d, ell, n, k, f, ns, layers = 7168, 3584, 896, 16, 3072, 2, 92
    rows = {
        "one routed expert": 3 * ell * f,
        "all routed experts": n * 3 * ell * f,
        "shared experts, merged": 3 * d * ns * f,
        "latent projections": 2 * d * ell,
        f"{k} routed experts": k * 3 * ell * f,
        "activated": k * 3 * ell * f + 3 * d * ns * f + 2 * d * ell,
        "router, on top": n * d,
        "routed experts": layers * n * 3 * ell * f,
        "activated per token": layers * (k * 3 * ell * f + 3 * d * ns * f + 2 * d * ell),
    }
    for label, value in rows.items():
        assert row_value(text, label) == f"{value:,}", label
    # The numbers K3's report states, literally.
    for literal in ("33,030,144", "29,595,009,024", "2,722,740,830,208", "528,482,304", "132,120,576",
                    "51,380,224", "711,983,104", "6,422,528", "2.72T", "65.5B"):
        assert literal in text, literal
    assert row_value(text, "share of K3's 2.78T") == f"{layers * n * 3 * ell * f / 2.78e12:.1%}" == "97.9%"
    # Payload: k l against k d, and the layer LatentMoE replaces sends the same as this one.
    assert row_value(text, "this layer (latent)") == f"{k * ell:,}" == "57,344"
    assert row_value(text, "full width, same k") == f"{k * d:,}"
    assert (k // 2) * d == k * ell and "the same traffic as the layer it replaces" in text
    assert row_value(text, "this layer in bf16 bytes") == f"{2 * k * ell:,}"
    # MXFP4: 4 bits per value plus one 8-bit scale per block of 32.
    routed = layers * n * 3 * ell * f
    assert f"{routed * (4 + 8 / 32) / 8 / 1e12:.2f} TB" in text and f"{routed * 2 / 1e12:.2f} TB" in text
    # Combinatorial sparsity, through exact integers.
    log_latent = math.log10(math.comb(896, 16))
    log_base = 2 * math.log10(math.comb(448, 8))
    assert row_value(text, "C(896, 16)") == f"{log_latent:.2f}" == "33.86"
    assert row_value(text, "C(448, 8)^2") == f"{log_base:.2f}" == "33.15"
    assert math.comb(896, 16) > math.comb(448, 8) ** 2
    assert f"is {math.comb(896, 16) / math.comb(448, 8) ** 2:.1f} times" in text
    assert_pngs(out, ["parameters.png", "combinations.png"])


# ---------------------------------------------------------------------------
# 03: SiTU-GLU against SwiGLU and a hard clamp
# ---------------------------------------------------------------------------

def sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def test_situ_vs_swiglu(tmp_path, capsys):
    text, r, out = run("03_situ_vs_swiglu", tmp_path, capsys)
    # 1. The bound, in every dtype: SiTU-GLU reaches it and never passes; SwiGLU overflows.
    for dtype in ("float64", "float32", "float16", "bfloat16"):
        row = re.search(rf"^ +{dtype} +(\S+) +(\S+) +(\S+)$", text, flags=re.M)
        assert row, dtype
        assert float(row.group(2)) == 100.0 and row.group(3) == "inf"
        assert r["bound"][dtype][0] <= 100.0
    # In exact arithmetic strictly below: the largest value on the moderate grid is at a = 60, b = 300.
    exact_top = 4 * math.tanh(60 / 4) * sigmoid(60.0) * 25 * math.tanh(300 / 25)
    assert r["moderate_max"] < 100.0
    assert r["moderate_max"] == pytest.approx(exact_top, rel=1e-15)
    assert f"100 - {100 - exact_top:.1e}" in text

    # 2. Third-order agreement of the cap, and the Taylor term printed beside it.
    for t in (1e-3, 1e-2, 1e-1):
        line = next(line for line in text.splitlines() if f"t = {t:.0e}:" in line)
        got, predicted = (float(v) for v in re.findall(r"[-+]?\d\.\d+e[-+]\d+", line))
        assert got == pytest.approx(4 * math.tanh(t / 4) - t, rel=1e-4)
        assert predicted == pytest.approx(-t**3 / 48, rel=1e-4)
    assert abs(r["softcap_slope"] - 3) < 0.02 and abs(r["glu_slope"] - 4) < 0.05
    assert f"{r['softcap_slope']:.2f} (the error is third order)" in text
    # Gradients near 0 agree (closed forms).
    line = next(line for line in text.splitlines() if "at (a, b) = (0.0, 1.0)" in line)
    assert f"SiTU-GLU ({0.5 * 25 * math.tanh(1 / 25):.5f}, 0.00000), SwiGLU (0.50000, 0.00000)" in line
    # Convergence: each tenfold increase of the caps divides the gap by about 100.
    gaps = r["convergence"]
    assert all(later < earlier for earlier, later in zip(gaps, gaps[1:], strict=False))
    assert gaps[-2] / gaps[-1] == pytest.approx(100, rel=0.05)
    assert "divides the gap by about 99" in text or "divides the gap by about 100" in text

    # 3. Derivatives past the bound: the softcap's stays positive, the clamp's is exactly 0.
    for z, soft, hard in re.findall(r"^ +(\d+(?:\.\d+)?) +(\d\.\d+e[-+]\d+) +(\d)$", text, flags=re.M):
        z = float(z)
        assert float(soft) == pytest.approx(1 / math.cosh(z / 4) ** 2, rel=1e-3)
        assert int(hard) == (1 if z < 4 else 0)
    assert np.all(r["soft_grad"] > 0) and np.all(r["hard_grad"][1:] == 0)
    assert number_after(text, "smallest softcap derivative over |z| <= 10 beta:") == f"{1 / math.cosh(10) ** 2:.3e}"
    assert "is 0 on 90% of that range" in text
    g = 4 * math.tanh(2 / 4) * sigmoid(2.0)
    line = next(line for line in text.splitlines() if "d/db at (a, b) = (2, 40)" in line)
    assert f"SiTU-GLU {g / math.cosh(40 / 25) ** 2:.4f}, clamped GLU 0, SwiGLU {2 * sigmoid(2.0):.4f}" in line
    # 4. The floating-point limits: where a correctly rounded tanh becomes 1, found independently by
    # stepping z in Python floats through 1 - 2 / (e^{2z} + 1) (each operation correctly rounded), and
    # NumPy's own tanh on either side; the sech^2 form is still positive far beyond.
    for name, dtype in (("float64", np.float64), ("float32", np.float32)):
        tanh_one, sigmoid_zero = r["limits"][name]
        z = next(k / 1000 for k in range(1000, 40000)
                 if dtype(1.0 - 2.0 / (math.exp(2 * k / 1000) + 1.0)) == dtype(1))
        assert abs(tanh_one - z) < 0.02, (name, tanh_one, z)
        assert sigmoid_zero == pytest.approx(-2 * tanh_one)
        assert f"{name}: tanh(z) rounds to 1 for z beyond {tanh_one:.2f}" in text
        assert f": True, exactly 1 at z = {tanh_one + 2:.2f}: True)" in text
    assert f"softcap_grad(z, 1) = {4 * math.exp(-80) / (1 + math.exp(-80)) ** 2:.3e}" in text
    assert_pngs(out, ["functions.png", "derivatives.png", "bound.png", "convergence.png"])


# ---------------------------------------------------------------------------
# As scripts
# ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("stem", ["01_forward_by_hand", "02_k3_accounting", "03_situ_vs_swiglu"])
def test_example_runs_as_a_script(stem, tmp_path):
    # Without --out nothing is written; the working directory stays clean.
    proc = subprocess.run([sys.executable, str(EXAMPLES / f"{stem}.py")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert list(tmp_path.iterdir()) == []
    assert "Warning" not in proc.stderr
