"""Shared pieces of the benchmark scripts: timing, the machine's own GEMM peak, machine facts, result files.

Every benchmark reports the **median** of several timed runs (after a warm-up
run that is not counted) together with the fastest and slowest run and the
relative spread, so a reader can tell a real difference from noise on a
shared machine. Speeds are set against the float32 matrix-product peak
measured **in the same run**, which is the only fair yardstick on a machine
whose load changes from minute to minute.

Results go to `docs/benchmarks/<name>.json` (everything, for tools) and
`docs/benchmarks/<name>.md` (a dated Markdown table with the machine, for the
docs site). The scripts are never part of the test run; the smoke tests only
check that they still work at tiny sizes.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "docs" / "benchmarks"

__all__ = [
    "RESULTS_DIR",
    "Timing",
    "base_parser",
    "blas_threads",
    "forward_flops",
    "gemm_peak",
    "gemm_work",
    "load_average",
    "machine_info",
    "markdown_table",
    "set_blas_threads",
    "time_call",
    "time_round_robin",
    "write_results",
]


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------

@dataclass
class Timing:
    """Wall-clock seconds of repeated runs of one piece of work."""

    name: str
    runs: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def best(self) -> float:
        return min(self.runs)

    @property
    def worst(self) -> float:
        return max(self.runs)

    @property
    def spread(self) -> float:
        """Interquartile range over the median: 0.05 means the middle half of the runs lie within 5 %."""
        if len(self.runs) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.runs, n=4, method="inclusive")
        return (q3 - q1) / self.median

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "median_s": self.median, "best_s": self.best, "worst_s": self.worst,
                "spread": self.spread, "runs_s": list(self.runs)}

    def __str__(self) -> str:
        return (f"{self.name}: median {fmt_seconds(self.median)} (best {fmt_seconds(self.best)}, "
                f"worst {fmt_seconds(self.worst)}, spread {100 * self.spread:.1f} %, {len(self.runs)} runs)")


def fmt_seconds(t: float) -> str:
    """A duration with a unit a reader takes in at a glance."""
    if t >= 1.0:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{1e3 * t:.1f} ms"
    return f"{1e6 * t:.0f} us"


def time_call(name: str, fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1,
              sync: Callable[[], None] | None = None) -> Timing:
    """Run `fn` `warmup` times untimed, then `repeats` times timed; `sync` waits for a device (CuPy)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
        if sync is not None:
            sync()
    timing = Timing(name)
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        timing.runs.append(time.perf_counter() - start)
    return timing


def time_round_robin(work: Mapping[str, Callable[[], Any]], *, repeats: int = 5, warmup: int = 1,
                     sync: Callable[[], None] | None = None, settle: float = 0.0) -> dict[str, Timing]:
    """Time several pieces of work in turns: round r runs each piece once, in order.

    On a shared machine the load drifts; taking turns spreads that drift
    evenly over the pieces, so their ratios (a layer against the GEMM peak,
    NumPy against PyTorch) stay fair even when the absolute times do not.
    `settle` seconds pass, untimed, before each timed run: threads that the
    piece before left spinning (an OpenBLAS thread spins for some 0.1 s after
    its product, waiting for the next one) are asleep by then instead of
    sharing the cores with the piece being timed.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if settle < 0:
        raise ValueError(f"settle must be >= 0 seconds, got {settle}")
    for _ in range(warmup):
        for fn in work.values():
            fn()
            if sync is not None:
                sync()
    timings = {name: Timing(name) for name in work}
    for _ in range(repeats):
        for name, fn in work.items():
            if settle:
                time.sleep(settle)
            start = time.perf_counter()
            fn()
            if sync is not None:
                sync()
            timings[name].runs.append(time.perf_counter() - start)
    return timings


# ---------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------

def gemm_work(size: int = 2048, dtype: Any = np.float32) -> tuple[Callable[[], Any], float]:
    """A square matrix product of `size` (the machine's yardstick) and its FLOPs, `2 size^3`."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size)).astype(dtype)
    b = rng.standard_normal((size, size)).astype(dtype)
    return (lambda: a @ b), 2.0 * size**3


def gemm_peak(*, size: int = 2048, repeats: int = 5, dtype: Any = np.float32) -> dict[str, Any]:
    """The machine's own matrix-product speed on its own: the timing and the GFLOP/s of the median and best run."""
    fn, flops = gemm_work(size, dtype)
    timing = time_call(f"{np.dtype(dtype).name} GEMM {size}^3", fn, repeats=repeats)
    return {"size": size, "dtype": np.dtype(dtype).name, "timing": timing,
            "gflops_median": flops / timing.median / 1e9, "gflops_best": flops / timing.best / 1e9}


def _openblas() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """NumPy's OpenBLAS thread getter and setter, found among the loaded libraries (Linux only)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "openblas" in line.lower()})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas", "64_"), ("scipy_openblas", ""), ("openblas", "64_"),
                               ("openblas", "")):
            get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
            put = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
            if get is not None and put is not None:
                put.argtypes = [ctypes.c_int]
                return get, put
    return None


def blas_threads() -> int | None:
    """Threads NumPy's BLAS uses now, or None where that cannot be read."""
    found = _openblas()
    return int(found[0]()) if found else None


def set_blas_threads(n: int) -> int | None:
    """Ask NumPy's BLAS to use `n` threads; returns the count it then reports (None if unknown)."""
    found = _openblas()
    if not found:
        return None
    found[1](int(n))
    return int(found[0]())


def available_cpus() -> int:
    """CPUs this process may run on (its affinity), which is what the thread pools should use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_id() -> str | None:
    """Vendor, family and model number from /proc/cpuinfo ("GenuineIntel family 6 model 207").

    A virtual machine often names its CPU only "Intel(R) Xeon(R) Processor";
    the model number still tells one generation from another.
    """
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if not line.strip():  # the first processor's block is enough
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return None
    if "vendor_id" not in fields:
        return None
    return f"{fields['vendor_id']} family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"


def _blas_name() -> str:
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except Exception:  # the layout of show_config differs between NumPy versions
        return "unknown"


def machine_info(**extra: Any) -> dict[str, Any]:
    """Facts a reader needs to judge the numbers: date, CPU, cores, load, library versions, threads."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "cpu_id": _cpu_id(),
        "cpus_available": available_cpus(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": _blas_name(),
        "blas_threads": blas_threads(),
    }
    info["load_average_at_start"] = load_average()
    info.update(extra)
    return info


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (runnable processes; above the CPU count means a busy machine)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


# ---------------------------------------------------------------------------
# What a forward pass must compute
# ---------------------------------------------------------------------------

def forward_flops(config: Any, m: int) -> dict[str, float]:
    """The FLOPs a Stable LatentMoE forward pass cannot avoid, by stage (2 per multiply-add).

    Only the matrix products count: the router ($n d$ per token), the latent
    down- and up-projections ($\\ell d$ each), the $k$ chosen experts
    ($3 \\ell f$ each) and the shared GLU ($3 d N_s f$). Activations, sorting
    and the norm are not counted, so "effective GFLOP/s" is this total over
    the whole wall time.
    """
    d, ell, n, k, f, s = config.d, config.ell, config.n, config.k, config.f, config.shared_size
    latent = 2 * m * d * ell if config.use_latent_projection else 0
    return {
        "router": 2.0 * m * n * d,
        "down_projection": float(latent),
        "routed_experts": 2.0 * m * k * 3 * ell * f,
        "up_projection": float(latent),
        "shared_experts": 2.0 * m * 3 * d * s,
    }


# ---------------------------------------------------------------------------
# Command line and result files
# ---------------------------------------------------------------------------

def base_parser(description: str) -> argparse.ArgumentParser:
    """The options every benchmark script shares."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes and one repeat: checks that the script works, measures nothing")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per measurement")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for NumPy's BLAS and PyTorch (default: every available CPU)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"folder for the JSON and Markdown results (default {RESULTS_DIR.relative_to(REPO)}; "
                             "a --smoke run writes only where --out says)")
    return parser


def output_dir(args: argparse.Namespace) -> Path | None:
    """Where to write results: `--out`, else the docs folder, except that a smoke run writes nothing by default."""
    if args.out is not None:
        return args.out
    return None if args.smoke else RESULTS_DIR


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table (numbers right-aligned)."""
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|")

    numeric = [all(isinstance(r[i], int | float) or _looks_numeric(r[i]) for r in rows) if rows else False
               for i in range(len(headers))]
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "|" + "|".join("---:" if num else "---" for num in numeric) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _looks_numeric(v: Any) -> bool:
    text = str(v).split(" ")[0].replace(",", "").replace("×", "").replace("%", "")
    try:
        float(text)
    except ValueError:
        return False
    return True


def _jsonable(value: Any) -> Any:
    if isinstance(value, Timing):
        return value.as_dict()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return value


def write_results(name: str, title: str, results: Mapping[str, Any], tables: Sequence[tuple[str, str]],
                  out_dir: Path | None, *, notes: Sequence[str] = ()) -> list[Path]:
    """Write `<name>.json` (all results) and `<name>.md` (dated page: machine, notes, tables) to `out_dir`.

    `tables` is a sequence of `(heading, markdown_table)`. Nothing is written when `out_dir` is None.
    Prints and returns the paths written.
    """
    if out_dir is None:
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = results.get("machine", {})
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(_jsonable(results), indent=2) + "\n")
    lines = [f"# {title}", ""]
    if machine:
        facts = [(k.replace("_", " "), ", ".join(map(str, v)) if isinstance(v, list) else v)
                 for k, v in machine.items() if v is not None]
        lines += [markdown_table(["machine", "value"], facts), ""]
    command = results.get("command")
    if command:
        lines += [f"Printed by `{command}`.", ""]
    for note in notes:
        lines += [note, ""]
    for heading, table in tables:
        lines += [f"## {heading}", "", table, ""]
    md_path = out_dir / f"{name}.md"
    md_path.write_text("\n".join(lines))
    for path in (json_path, md_path):
        print(f"wrote {path}")
    return [json_path, md_path]


def command_line() -> str:
    """How this script was started, for the results page (paths relative to the repository)."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(REPO)
    except ValueError:
        pass
    return " ".join(["python", str(script), *sys.argv[1:]])
