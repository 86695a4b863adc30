"""Shared fixtures: the array backends every numerical test runs on.

`xp` is parametrized over NumPy, `array_api_strict` (which refuses anything
outside the array-API standard, so a NumPy-only call cannot slip in) and CuPy
when a working GPU is present. Tests convert their inputs with `xp.asarray`
and their outputs back with `refimpl._lib.xp.to_numpy`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import array_api_strict
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

#: The environment this test process started with. OpenBLAS reads its settings once, when NumPy is first
#: imported; a test that later sets one (an example's `os.environ.setdefault`) changes nothing it reports.
STARTING_ENVIRONMENT = dict(os.environ)

# Hypothesis profiles. "ci" is what `make test` and .ci/run use (no environment variable set): the draws
# are a function of each test alone (derandomize), so a failure reproduces on every machine, and the
# per-machine example database is neither read nor written. "dev" hunts for new counterexamples: ten
# times the examples, fresh random draws on every run; each one it finds becomes an @example in the test.
#   HYPOTHESIS_PROFILE=dev pytest tests/test_mx.py
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True, database=None,
                          max_examples=60, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", derandomize=False, deadline=None, print_blob=True, max_examples=600,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _cupy_or_reason() -> tuple[object | None, str]:
    """CuPy if it imports and runs a tiny kernel on a GPU, else the reason it cannot."""
    try:
        import cupy
    except Exception as exc:  # not installed
        return None, f"CuPy is not installed ({type(exc).__name__})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "CuPy is installed but sees no GPU"
        if int((cupy.arange(3) + 1).sum().item()) != 6:
            return None, "CuPy's test kernel returned a wrong result"
    except Exception as exc:
        return None, f"CuPy is installed but no GPU is usable ({type(exc).__name__})"
    return cupy, ""


CUPY, CUPY_REASON = _cupy_or_reason()

BACKENDS = [
    pytest.param(np, id="numpy"),
    pytest.param(array_api_strict, id="array_api_strict"),
    pytest.param(CUPY, id="cupy", marks=pytest.mark.skipif(CUPY is None, reason=CUPY_REASON)),
]


def _refuse_implicit_conversion(self, *args, **kwargs):
    raise TypeError("array_api_strict arrays are not converted to NumPy implicitly in the tests (CuPy's rule); "
                    "use refimpl._lib.xp.to_numpy")


@pytest.fixture(params=BACKENDS)
def xp(request, monkeypatch):
    """An array namespace: NumPy, array_api_strict, or CuPy on a GPU machine.

    With array_api_strict, `np.asarray(x)` on its arrays raises, as it does on
    CuPy's: a test or a function that converts implicitly fails here, on every
    machine, rather than only where a GPU is present.
    """
    if request.param is array_api_strict:
        # NumPy reaches for the buffer protocol first (Python 3.12 and later), then for __array__.
        for method in ("__buffer__", "__array__"):
            monkeypatch.setattr(array_api_strict._array_object.Array, method, _refuse_implicit_conversion)
    return request.param


# ---------------------------------------------------------------------------
# Scripts (examples, benchmarks, the page generator) imported as modules
# ---------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: Path, name: str) -> ModuleType:
    """Import the script at `path` as the module `name` (examples/, benchmarks/ and docs/ are not packages).

    The module is registered in `sys.modules`, where dataclasses and pickling look it up.
    """
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class ServedSite:
    """A built site served by `make serve`'s own server (`docs/serve.py`) on a free port, in a thread, while a
    `with` block runs; `get(path)` answers (status, final URL, body), following redirects."""

    def __init__(self, site: Path, prefix: str | None = None) -> None:
        import threading

        serve = load_script(ROOT / "docs" / "serve.py", "refimpl_docs_serve")
        self.server = serve.make_server(site, 0, prefix=prefix)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ServedSite:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def get(self, path: str) -> tuple[int, str, bytes]:
        """An HTTP error is a status here, not raised."""
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(self.base + path, timeout=30) as response:
                return response.status, response.url, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.url, error.read()


def load_example(stem: str) -> ModuleType:
    """`examples/<stem>.py` as a module."""
    return load_script(ROOT / "examples" / f"{stem}.py", f"example_{stem}")


# ---------------------------------------------------------------------------
# MPI jobs started from a test
# ---------------------------------------------------------------------------

MPIEXEC = Path(sys.executable).parent / "mpiexec"


def run_under_mpiexec(ranks: int, args: list[str], *, timeout: float = 120):
    """`mpiexec -n ranks python -m mpi4py ARGS` from the repository root; the finished process's output.

    The launcher is the MPICH wheel's, next to the test interpreter. The job
    runs in a session of its own, so that a hung job is killed whole (launcher
    and ranks) when the timeout passes, and the test fails with what it printed.
    """
    return run_mpiexec(["-n", str(ranks), sys.executable, "-m", "mpi4py", *args], timeout=timeout)


def run_mpiexec(args: list[str], *, timeout: float = 120, env: dict[str, str] | None = None):
    """`mpiexec ARGS` from the repository root (any command line, several programs included); as `run_under_mpiexec`.

    `env` adds to the environment the job runs in.
    """
    import signal
    import subprocess

    assert MPIEXEC.is_file(), f"no mpiexec next to {sys.executable}: install the test extra (mpi4py, mpich)"
    command = [str(MPIEXEC), *args]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}, **(env or {})}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{' '.join(command)} did not finish in {timeout} s:\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
