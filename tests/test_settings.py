"""The machine settings a run was asked for are the ones in force.

`make test-variants` runs the suite again under the settings in which one
machine's arithmetic differs from another's: one BLAS thread or two, one
core, another BLAS kernel (`OPENBLAS_CORETYPE`), and NumPy without its wider
vector paths (`NPY_DISABLE_CPU_FEATURES`). A setting that silently did not
take would make such a run prove nothing, so each one asked for in the
environment is checked here against what the libraries report: threadpoolctl
for OpenBLAS, NumPy's own table of CPU features, and the process's CPU
affinity. With none of them set, the test checks nothing and says so.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import STARTING_ENVIRONMENT
from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
from threadpoolctl import threadpool_info


def openblas() -> dict:
    found = [lib for lib in threadpool_info() if lib.get("internal_api") == "openblas"]
    assert found, "NumPy's BLAS is not OpenBLAS here"
    return found[0]


def test_the_settings_asked_for_took_effect():
    np.ones((64, 64)) @ np.ones((64, 64))  # OpenBLAS reads its settings when it first runs
    checked = []
    if threads := STARTING_ENVIRONMENT.get("OPENBLAS_NUM_THREADS"):
        assert openblas()["num_threads"] == int(threads)
        checked.append("OPENBLAS_NUM_THREADS")
    if STARTING_ENVIRONMENT.get("OPENBLAS_CORETYPE"):
        # OpenBLAS reports its kernel under its own name (Prescott's is "Katmai" in some builds): the check is
        # that it is not the kernel the same process picks by itself.
        env = {k: v for k, v in STARTING_ENVIRONMENT.items() if k != "OPENBLAS_CORETYPE"}
        probe = "import numpy as np, threadpoolctl as t; np.ones((8, 8)) @ np.ones((8, 8)); " \
                "print([i['architecture'] for i in t.threadpool_info() if i.get('internal_api') == 'openblas'][0])"
        default = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        assert openblas()["architecture"] != default.stdout.strip(), default.stdout
        checked.append("OPENBLAS_CORETYPE")
    if disabled := STARTING_ENVIRONMENT.get("NPY_DISABLE_CPU_FEATURES"):
        names = disabled.replace(",", " ").split()
        assert names and all(name in __cpu_dispatch__ for name in names), (names, __cpu_dispatch__)
        assert not any(__cpu_features__[name] for name in names), {n: __cpu_features__[n] for n in names}
        checked.append("NPY_DISABLE_CPU_FEATURES")
    if cores := STARTING_ENVIRONMENT.get("REFIMPL_EXPECT_CPUS"):
        assert len(os.sched_getaffinity(0)) == int(cores)
        checked.append("CPU affinity")
    if not checked:
        pytest.skip("no machine setting was asked for (make test-variants sets them)")
