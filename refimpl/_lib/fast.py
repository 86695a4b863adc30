r"""Fast paths: the readable code's arithmetic, arranged for NumPy (and one CuPy kernel).

Every page of this package computes its equation the plain way first, with
array-API calls that run on NumPy, CuPy and `array_api_strict` alike. A few
of those computations are hot at the sizes people run (the benchmark layer,
K3's 896 experts, a million margins), and on a CPU their cost is not the
arithmetic but what surrounds it: fresh temporaries that the kernel must map
and zero, passes over memory that does not fit in cache, full sorts where a
selection would do. This module holds the versions that avoid those costs,
**and nothing else**:

| fast path | speeds up | by |
|---|---|---|
| `glu_in_place`, `glu_by_chunks`, `glu_and_grad_by_chunks` | `refimpl.layer.activations.expert_glu`, `expert_glu_and_grad` | writing every step into the products' own buffers, fewer exponentials |
| `routed_experts_in_buffers`, `routed_experts_backward_in_buffers`, `combine_in_buffers` | the routed expert loops of `refimpl.layer.latent_moe` and `refimpl.layer.backward`, `combine` | gathering into reused buffers, writing products with `out=` |
| `for_each_on_threads`, `loop_threads`, `LOOP_THREADS` | the two loops above, the activation's row chunks, the combine's and the fingerprints' blocks, on several threads | whole experts (or chunks, or blocks) on each thread, each with a one-threaded BLAS |
| `on_own_threads`, `HELD_FROM`, `matmul`, `THREADED_PRODUCT`, `POOLED_PRODUCT` | a large layer's forward and backward (`stable_latent_moe`, `stable_latent_moe_vjp`) and their large products | the BLAS held at one thread for the whole call, each large product cut into blocks of rows or columns on the loops' threads, so that no idle BLAS thread spins beside them; large results from the pool |
| `rms_norm_by_chunks`, `rms_norm_backward_by_chunks` | `refimpl.layer.activations.rms_norm`, `rms_norm_backward` | a few rows at a time, in cache, on several threads |
| `WorkspacePool`, `WORKSPACES`, `release_workspaces` | every large array of the two loops above, from one call to the next | handing an array out again only once nothing outside the pool refers to it |
| `blas_flags_ignored` | the products of `matmul` and of the routed expert loops | ignoring the "invalid" flag a BLAS may leave after a product of finite operands (the result is what counts) |
| `fingerprint`, `FINGERPRINT_COLUMNS`, `FINGERPRINT_ROWS` | the weights' fingerprints of `refimpl.layer.backward.stable_latent_moe_vjp` | integer sums of the raw bytes by rows and columns of cache-sized blocks, exact in any order, on several threads, instead of a hash or a copy of every byte |
| `input_backward_in_one_product` | the input's gradient in `refimpl.layer.backward.router_and_input_backward` | four products that are summed, as one product of concatenated operands |
| `topk_by_partition` | `refimpl._lib.xp.topk` | partitioning instead of sorting each row |
| `kth_largest_by_sampling`, `kth_largest_cupy` | `refimpl.balancing.kth_largest` | a sample that discards most entries first (Floyd and Rivest), CuPy's selection kernel |
| `cutoffs_by_blocks`, `expert_major_margins_by_blocks` | Eq. (14)'s cutoffs and margins | blocks of tokens that stay in cache |
| `histogram_count_by_experts` | Appendix D's scatter-add | a few experts at a time, in reused buffers |

Each function computes what the readable version computes, and
`tests/test_fast.py` holds each one against the readable code it replaces
(bit for bit where the operations are the same, to rounding where the order
of a sum changes). The readable module decides, in one line, when the fast
path applies (`fast_path_applies`); a reader can ignore this page entirely.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "COMBINE_BLOCK",
    "CUTOFF_BLOCK",
    "ENABLED",
    "FINGERPRINT_COLUMNS",
    "FINGERPRINT_ROWS",
    "GLU_CHUNK",
    "HELD_FROM",
    "LOOP_THREADS",
    "PASS_MARGINS",
    "POOLED_PRODUCT",
    "THREADED_CHUNKS",
    "THREADED_PRODUCT",
    "TRANSPOSE_BLOCK",
    "WORKSPACES",
    "blas_flags_ignored",
    "combine_in_buffers",
    "cutoffs_by_blocks",
    "enabled",
    "expert_major_margins_by_blocks",
    "fast_path_applies",
    "fingerprint",
    "for_each_on_threads",
    "glu_and_grad_by_chunks",
    "glu_and_grad_in_place",
    "glu_by_chunks",
    "glu_in_place",
    "histogram_count_by_experts",
    "input_backward_in_one_product",
    "kth_largest_by_sampling",
    "kth_largest_cupy",
    "loop_threads",
    "matmul",
    "on_own_threads",
    "release_workspaces",
    "rms_norm_backward_by_chunks",
    "rms_norm_by_chunks",
    "routed_experts_backward_in_buffers",
    "routed_experts_in_buffers",
    "topk_by_partition",
    "WorkspacePool",
]


#: Switch the fast paths off (`False`) to run every teaching module's readable code, as the tests do.
ENABLED = True


def enabled() -> bool:
    """Whether the fast paths are on (`ENABLED`): every dispatch to a fast path asks this, or `fast_path_applies`."""
    return ENABLED


def fast_path_applies(*arrays: Any) -> bool:
    """True when every array is a NumPy float32 or float64 array, all of one dtype: where these paths run."""
    if not ENABLED or not arrays or not all(isinstance(a, np.ndarray) for a in arrays):
        return False
    dtype = arrays[0].dtype
    return dtype in (np.float32, np.float64) and all(a.dtype == dtype for a in arrays)


# ---------------------------------------------------------------------------
# Workspaces kept between calls
# ---------------------------------------------------------------------------

def _references(arrays: list, i: int) -> int:
    """How many references the interpreter counts to `arrays[i]` (the list's own included), asked one fixed way."""
    return sys.getrefcount(arrays[i])


#: What `_references` answers for an array that only its list holds, measured once on this interpreter.
_ALONE = _references([np.empty(1)], 0)


class WorkspacePool:
    r"""Arrays kept from one call to the next, by shape and dtype, so that a training step maps no fresh memory.

    A large NumPy array is memory the operating system maps for it and
    zeroes page by page when it is first written; at the benchmark size the
    expert gradient stacks alone are 300 MB a step, and mapping them again
    at every step costs as much as a third of the step's arithmetic.
    `empty(shape, dtype)` returns an array this pool made before **only when
    nothing outside the pool refers to it any more** — no variable, no view
    or slice of it, no memoryview or tensor built on it, no `MoEOutput` or
    `backward` function that keeps it — and a new one otherwise. So an array
    returned to a caller is never handed out again while the caller can
    still see it: a caller's gradients stay the caller's until the caller
    lets them go, and only then does their memory serve a later call (what
    PyTorch's caching allocator does with freed tensors). Only a raw address
    taken out of an array (`a.ctypes.data`) escapes this count.

    The pool remembers at most `keep` arrays of each shape and dtype; when
    all of them are in use it makes a new one and forgets the oldest (which
    stays its holder's). It remembers at most `kinds` shapes and dtypes,
    forgetting the one used longest ago. So the memory it holds on its own
    is at most `keep` arrays of each of `kinds` kinds, and `release()` gives
    all of it back.
    Thread-safe: the search for an unreferenced array and the handing out
    happen under one lock, and an array handed out is referenced by its
    taker before the lock is released. On an interpreter without the global
    lock (a free-threaded build) reference counts are not exact, and the
    pool makes a new array every time.
    """

    def __init__(self, keep: int = 4, kinds: int = 32) -> None:
        self.keep, self.kinds = keep, kinds
        self._arrays: dict[tuple[tuple[int, ...], str], list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self._exact = getattr(sys, "_is_gil_enabled", lambda: True)()

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialized C-contiguous array of `shape` and `dtype` that nothing else refers to."""
        shape, dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        if not self._exact:
            return np.empty(shape, dtype=dtype)
        with self._lock:
            arrays = self._arrays.pop((shape, dtype.str), [])
            self._arrays[(shape, dtype.str)] = arrays  # the kind used last goes last
            if len(self._arrays) > self.kinds:  # batches of many sizes: forget the kind used longest ago
                del self._arrays[next(iter(self._arrays))]
            for i in range(len(arrays)):
                if _references(arrays, i) == _ALONE:
                    return arrays[i]
            arrays.append(np.empty(shape, dtype=dtype))
            if len(arrays) > self.keep:
                del arrays[0]  # every one is in use: its holder keeps it, the pool stops recycling it
            return arrays[-1]

    def held_bytes(self) -> int:
        """Bytes of the arrays the pool remembers and nobody else refers to: what `release()` would free."""
        with self._lock:
            return sum(arrays[i].nbytes for arrays in self._arrays.values() for i in range(len(arrays))
                       if _references(arrays, i) == _ALONE)

    def release(self) -> int:
        """Forget every array; returns the bytes that were held by the pool alone (now freed)."""
        held = self.held_bytes()
        with self._lock:
            self._arrays.clear()
        return held


#: The pool of the NumPy fast paths of the layer's forward and backward.
WORKSPACES = WorkspacePool()


def release_workspaces() -> int:
    """Free the memory the layer's fast paths keep between calls (`WORKSPACES`); returns the bytes freed.

    The next call makes its arrays anew (and keeps them again). Arrays a
    caller still holds (gradients, a `MoEOutput`) are not touched.
    """
    return WORKSPACES.release()


# ---------------------------------------------------------------------------
# The expert activation, in place
# ---------------------------------------------------------------------------

def glu_in_place(a: np.ndarray, b: np.ndarray, activation: str, beta: float,
                 linear_beta: float | None) -> np.ndarray:
    r"""The expert GLU of fresh products `a`, `b` (float32/float64 blocks), overwriting both; returns `a`.

    The formula of `refimpl.layer.activations.situ_glu` (or `swiglu`), each step
    written with `out=` so that an expert's `[m_e, f]` block is transformed
    where it lies, in cache, with one temporary instead of a dozen. The
    sigmoid is the branch-free accurate form of `refimpl.layer.activations.sigmoid`,
    $\sigma(a) = e^{\min(a, 0)} / (1 + e^{-|a|})$.
    """
    if activation == "relu2":  # max(a, 0) b: with tied gate and up weights, max(u, 0)^2
        np.maximum(a, 0.0, out=a)
        a *= b
        return a
    sig = np.minimum(a, 0.0)  # [m_e, f], the only temporary besides the denominator
    np.exp(sig, out=sig)
    denominator = np.abs(a)
    np.negative(denominator, out=denominator)
    np.exp(denominator, out=denominator)
    denominator += 1.0
    sig /= denominator
    if activation == "situ":
        np.divide(a, beta, out=a)
        np.tanh(a, out=a)
        a *= beta  # softcap(a, beta1)
        if linear_beta is not None:  # None: the up branch stays uncapped
            np.divide(b, linear_beta, out=b)
            np.tanh(b, out=b)
            b *= linear_beta  # softcap(b, beta2)
    a *= sig
    a *= b
    return a


def glu_and_grad_in_place(a: np.ndarray, b: np.ndarray, activation: str, beta: float, linear_beta: float | None,
                          da: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""`refimpl.layer.activations.glu_and_grad` in place: $h$ over `a`, $\partial_b\phi$ over `b`, $\partial_a\phi$ into `da`.

    Three temporaries instead of some twenty, and one `exp`, two `cosh` and
    two `tanh` per entry instead of six `exp` and two `tanh`: the calls are
    what costs most on a CPU. Two identities save them. With $t = e^{-|a|}$
    and $r = 1/(1+t)$, $\sigma(a) = \max(t, [a \ge 0])\,r$ and
    $\sigma'(a) = \sigma(a)\sigma(-a) = t r^2$. The derivative of a cap is
    $\operatorname{sech}^2(u) = (1/\cosh u)^2$, which has no cancellation
    (unlike $1 - \tanh^2 u$, exactly 0 once $\tanh u$ rounds to 1) and
    follows the true value down to the smallest subnormal number: $\cosh u$
    overflows to infinity only past $|u| \approx 89$ in float32, where
    $\operatorname{sech}^2 u < 10^{-77}$ rounds to 0 anyway. (Getting $\tanh$
    from $e^{-2|u|}$, as $(1-e)/(1+e)$, would save one more call but loses
    digits.)
    """
    if activation == "relu2":  # gamma(a) = max(a, 0), gamma'(a) = [a > 0], lambda(b) = b
        gamma_prime = np.multiply(a > 0, b, out=da)  # d_a phi = [a > 0] b
        np.maximum(a, 0.0, out=a)  # gamma(a)
        h = a * b  # h = gamma(a) b
        np.copyto(b, a)  # d_b phi = gamma(a)
        np.copyto(a, h)
        return a, gamma_prime, b
    situ = activation == "situ"
    scratch = np.abs(a)
    gamma_prime = np.negative(scratch, out=da)
    np.exp(gamma_prime, out=gamma_prime)  # t = e^{-|a|}
    r = gamma_prime + 1.0
    np.reciprocal(r, out=r)  # r = 1 / (1 + t)
    sig = np.maximum(gamma_prime, a >= 0)
    sig *= r  # sigma(a)
    gamma_prime *= r
    gamma_prime *= r  # sigma'(a) = t r^2
    with np.errstate(over="ignore"):  # cosh(u) = inf far past the cap: 1/inf = 0, the rounded sech^2
        if situ:
            u = np.divide(a, beta, out=scratch)
            sech2 = np.cosh(u, out=r)
            np.reciprocal(sech2, out=sech2)
            sech2 *= sech2  # sech^2(a / beta1)
            gamma = np.tanh(u, out=u)
            gamma *= beta  # softcap(a, beta1)
            gamma_prime *= gamma
            sech2 *= sig
            gamma_prime += sech2  # gamma'(a) = sech^2(a/beta1) sigma(a) + softcap(a, beta1) sigma'(a)
            gamma *= sig  # gamma(a) = softcap(a, beta1) sigma(a)
        else:
            gamma = np.multiply(a, sig, out=scratch)  # a sigma(a)
            gamma_prime *= a
            gamma_prime += sig  # sigma(a) + a sigma'(a)
        lam_prime = None
        if situ and linear_beta is not None:
            b /= linear_beta  # b / beta2
            lam_prime = np.cosh(b, out=sig)
            np.reciprocal(lam_prime, out=lam_prime)
            lam_prime *= lam_prime  # lambda'(b) = sech^2(b / beta2)
            np.tanh(b, out=b)
            b *= linear_beta  # lambda(b) = softcap(b, beta2)
    h = np.multiply(gamma, b, out=a)  # h = gamma(a) lambda(b)
    gamma_prime *= b  # d_a phi = gamma'(a) lambda(b)
    if lam_prime is not None:
        d_up = np.multiply(lam_prime, gamma, out=b)  # d_b phi = gamma(a) lambda'(b)
    else:
        np.copyto(b, gamma)  # uncapped: d_b phi = gamma(a)
        d_up = b
    return h, gamma_prime, d_up


#: Entries of a block that the in-place GLU transforms at a time (some 131,000, 512 KB of float32): its
#: temporaries then stay in the core's own cache instead of streaming through memory once per operation, and an
#: expert's block at the benchmark size (256 rows of 384) is one chunk. Smaller chunks cost one thread nothing
#: but slowed a step on two threads by some 5 % (16,384 entries; `benchmarks/profile_backward.py --threads 2`
#: times both), most likely because each NumPy call must take the
#: interpreter's lock to start, and two threads making many short calls wait for each other at it.
GLU_CHUNK = 1 << 17


#: Chunks a block must have before they are shared among threads: below this the threads' start costs more
#: than they save (an expert's block inside the expert loops is never split further: it is already on a thread).
THREADED_CHUNKS = 16


def _row_chunks(a: np.ndarray) -> list[slice]:
    """The row slices of a 2-D block of at most `GLU_CHUNK` entries each (one row when rows are longer)."""
    step = max(1, GLU_CHUNK // max(1, a.shape[-1]))
    return [slice(start, start + step) for start in range(0, a.shape[0], step)]


def _on_chunks(chunks: list[slice], work: Callable[[int, slice], None]) -> None:
    """`work(i, chunks[i])` for every chunk: on `loop_threads` threads once there are `THREADED_CHUNKS` of them."""
    tasks = list(enumerate(chunks))
    if len(tasks) >= THREADED_CHUNKS:
        for_each_on_threads(tasks, lambda task, _: work(*task))
    else:
        for task in tasks:
            work(*task)


def glu_by_chunks(a: np.ndarray, b: np.ndarray, activation: str, beta: float,
                  linear_beta: float | None) -> np.ndarray:
    """`glu_in_place` a few rows at a time (on several threads for a large block); returns `a`.

    Each entry's arithmetic is `glu_in_place`'s whatever the chunk or thread, so
    the values are those of one call on the whole block. A block that is not a
    C-contiguous matrix (or stack of them) is transformed in one call.
    """
    if not (a.ndim >= 2 and a.flags.c_contiguous and b.flags.c_contiguous and a.shape == b.shape):
        return glu_in_place(a, b, activation, beta, linear_beta)
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])  # [rows, f] views
    _on_chunks(_row_chunks(a2),
               lambda _, rows: glu_in_place(a2[rows], b2[rows], activation, beta, linear_beta))
    return a


def glu_and_grad_by_chunks(a: np.ndarray, b: np.ndarray, activation: str, beta: float,
                           linear_beta: float | None, da: np.ndarray | None = None,
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`glu_and_grad_in_place` on a 2-D C-contiguous block, a few rows at a time; returns `(a, da, b)`.

    `da` (a writeable C-contiguous array of `a`'s shape and dtype, else a
    `ValueError`) receives the gate's partial; without it, an array of the
    pool (`WORKSPACES`) does. A block of
    `THREADED_CHUNKS` chunks or more shares them among `loop_threads`
    threads; each entry's arithmetic is the same either way.
    """
    if not (a.ndim == 2 and a.flags.c_contiguous and b.flags.c_contiguous):
        a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if da is None:
        da = WORKSPACES.empty(a.shape, a.dtype)  # [rows, f]
    elif not (isinstance(da, np.ndarray) and da.shape == a.shape and da.dtype == a.dtype
              and da.flags.c_contiguous and da.flags.writeable):
        got = (f"an array of shape {list(da.shape)}, dtype {da.dtype}, C-contiguous {da.flags.c_contiguous}, "
               f"writeable {da.flags.writeable}") if isinstance(da, np.ndarray) else f"a {type(da).__name__}"
        raise ValueError(f"the buffer for the gate's partial (d_gate_out) must be a writeable C-contiguous NumPy "
                         f"array of shape {list(a.shape)} and dtype {a.dtype}, got {got}")
    _on_chunks(_row_chunks(a), lambda _, rows: glu_and_grad_in_place(a[rows], b[rows], activation, beta,
                                                                      linear_beta, da[rows]))
    return a, da, b


# ---------------------------------------------------------------------------
# RMSNorm by rows
# ---------------------------------------------------------------------------

def rms_norm_by_chunks(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    r"""`refimpl.layer.activations.rms_norm` of a C-contiguous `[m, width]` block, a few rows at a time.

    The readable norm makes four arrays of the block's size (the squares,
    $x/\operatorname{rms}$, the product by the gain, the result), each of
    them fresh memory; here each chunk of rows (`GLU_CHUNK` entries) makes
    its squares in cache and writes its result once (into an array of the
    pool, `WORKSPACES`), and a block of
    `THREADED_CHUNKS` chunks or more shares them among `loop_threads`
    threads. Every entry goes through the readable norm's operations in
    its order (a row's mean is the same sum), so the values are equal bit
    for bit.
    """
    out = WORKSPACES.empty(x.shape, x.dtype)  # [m, width]

    def chunk(_: int, rows: slice) -> None:
        block = x[rows]  # [c, width]
        rms = np.mean(block * block, axis=-1, keepdims=True)  # [c, 1]
        rms += eps
        np.sqrt(rms, out=rms)
        np.divide(block, rms, out=out[rows])
        out[rows] *= weight

    _on_chunks(_row_chunks(x), chunk)
    return out


def rms_norm_backward_by_chunks(u: np.ndarray, weight: np.ndarray, dv: np.ndarray,
                                eps: float) -> tuple[np.ndarray, np.ndarray]:
    r"""`refimpl.layer.activations.rms_norm_backward` of C-contiguous `[m, width]` blocks, a few rows at a time.

    Each chunk of rows forms $\rho$, $\hat u$ and $\bar{\hat u}$ in cache and
    writes its rows of $\bar u$ once, into an array of the pool (the
    readable code makes some eight arrays of the block's size); $\bar u$
    is equal bit for bit. The gain's
    gradient $\bar g = \sum_i \bar v_i \odot \hat u_i$ is summed per chunk,
    then over the chunks in order: the same terms in another order than
    the readable sum's, and the same whatever the thread count.
    """
    du = WORKSPACES.empty(u.shape, u.dtype)  # [m, width]
    chunks = _row_chunks(u)
    partial = np.empty((len(chunks), u.shape[1]), dtype=u.dtype)  # [chunks, width]

    def chunk(i: int, rows: slice) -> None:
        block, dv_block = u[rows], dv[rows]  # [c, width]
        rho = np.mean(block * block, axis=-1, keepdims=True)  # [c, 1]
        rho += eps
        np.sqrt(rho, out=rho)
        u_hat = block / rho
        np.sum(dv_block * u_hat, axis=0, out=partial[i])  # this chunk's part of the gain's gradient
        du_hat = dv_block * weight
        projection = np.mean(du_hat * u_hat, axis=-1, keepdims=True)  # [c, 1]
        u_hat *= projection
        du_hat -= u_hat
        np.divide(du_hat, rho, out=du[rows])

    _on_chunks(chunks, chunk)
    return du, np.sum(partial, axis=0)


# ---------------------------------------------------------------------------
# The expert loops on several threads
# ---------------------------------------------------------------------------

#: Threads the fast paths' loops (experts, row chunks, blocks) run on. `None` (the default) follows NumPy's BLAS: as many threads as it
#: may use (`threadpoolctl` reports them), each running whole experts with a one-threaded BLAS. `1` runs the
#: experts in order on the calling thread, every product on the BLAS's own threads.
LOOP_THREADS: int | None = None


class _BlasThreads:
    """NumPy's BLAS thread count, read and (while expert loops run on threads of their own) set to one.

    Setting it is global to the process, so it is counted: the first loop to
    start saves the count and sets one, the last to finish restores it, and
    loops that overlap (called from several threads of the caller) leave the
    caller's setting as it was.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._libraries: list | None = None
        self._active, self._saved = 0, [1]

    def libraries(self) -> list:
        """threadpoolctl's controllers of the BLAS NumPy calls (all loaded BLAS if none lives in NumPy's folders)."""
        if self._libraries is None:
            try:
                from threadpoolctl import ThreadpoolController
            except ImportError:  # without threadpoolctl the loops stay on one thread
                self._libraries = []
            else:
                blas = ThreadpoolController().select(user_api="blas").lib_controllers
                numpy_own = [lib for lib in blas if "numpy" in str(lib.filepath)]
                self._libraries = numpy_own or blas
        return self._libraries

    def count(self) -> int:
        """How many threads NumPy's BLAS may use now, as the caller left it (1 when nobody can tell)."""
        with self._lock:
            if self._active:
                return max(self._saved)
        return max((lib.num_threads for lib in self.libraries()), default=1)

    def __enter__(self) -> None:
        with self._lock:
            if self._active == 0:
                self._saved = [lib.num_threads for lib in self.libraries()]
                for lib in self.libraries():
                    lib.set_num_threads(1)
            self._active += 1

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                for lib, threads in zip(self.libraries(), self._saved, strict=True):
                    lib.set_num_threads(threads)


_BLAS = _BlasThreads()
_WORKERS: dict[str, Any] = {"pool": None, "size": 0}
_WORKERS_LOCK = threading.Lock()
_IN_WORKER = threading.local()
_DONE = object()


def _reset_in_forked_child() -> None:
    """A child made by `fork` has only the thread that forked: it forgets the parent's pool and its locks.

    Without this, a loop in the child (a worker of `multiprocessing`'s fork
    context, say) would hand its tasks to threads that exist only in the
    parent and wait for them forever; a lock some other parent thread held
    at the fork would never be released.
    """
    global _WORKERS_LOCK, _WORKSPACES_TAKEN_LOCK
    _WORKERS["pool"], _WORKERS["size"] = None, 0
    _WORKERS_LOCK = threading.Lock()
    _WORKSPACES_TAKEN_LOCK = threading.Lock()
    WORKSPACES._lock = threading.Lock()
    _BLAS._lock = threading.Lock()
    if _BLAS._active:  # forked while a loop held the BLAS at one thread: the child gets the caller's count back
        _BLAS._active = 0
        for lib, threads in zip(_BLAS.libraries(), _BLAS._saved, strict=False):
            lib.set_num_threads(threads)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_forked_child)


def loop_threads(tasks: int) -> int:
    """How many threads a loop over `tasks` tasks runs on: `LOOP_THREADS`, else NumPy's BLAS threads.

    Never more than there are tasks, and 1 inside a worker of these loops
    (a layer called from a loop's own work runs in order).
    """
    if LOOP_THREADS is not None and (isinstance(LOOP_THREADS, bool) or not isinstance(LOOP_THREADS, int)
                                     or LOOP_THREADS < 1):
        raise ValueError(f"refimpl._lib.fast.LOOP_THREADS must be None (follow NumPy's BLAS) or a positive "
                         f"integer, got {LOOP_THREADS!r}")
    if getattr(_IN_WORKER, "active", False):
        return 1
    wanted = LOOP_THREADS if LOOP_THREADS is not None else _BLAS.count()
    return max(1, min(int(wanted), tasks))


def _no_buffers() -> None:
    return None


def for_each_on_threads(tasks: list, work: Callable[[Any, Any], None],
                        buffers: Callable[[], Any] = _no_buffers) -> None:
    r"""Run `work(task, buffers)` for every task (an expert, a chunk of rows): in order, or on `loop_threads` threads.

    On one thread the tasks run in order with one set of `buffers()`. On
    $T > 1$ threads each thread makes its own buffers and takes the next
    task not yet taken until none is left, while NumPy's BLAS runs on one
    thread: $T$ experts' products and elementwise work proceed at once, which
    at an expert's sizes (some 256 rows) is faster than one product split
    over $T$ threads (small products split badly, and NumPy's elementwise
    work has no threads of its own). Every task writes only its own rows
    and its own gradient blocks, and each product is computed by the same
    one-threaded BLAS call whatever thread runs it, so the results do not
    depend on the thread count. The calling thread is one of the $T$: it
    takes tasks too, while $T - 1$ threads of a pool kept between calls
    join it (waking a sleeping thread is slow on some machines, a wait a
    loop of short tasks would otherwise make for every thread).
    The first error raised by any task is raised here once every thread
    has stopped.
    """
    threads = loop_threads(len(tasks))
    if threads == 1:
        mine = buffers()
        for task in tasks:
            work(task, mine)
        return
    with _WORKERS_LOCK:
        if _WORKERS["size"] < threads - 1:  # a pool as large as the largest loop asked for, kept for the next one
            from concurrent.futures import ThreadPoolExecutor

            if _WORKERS["pool"] is not None:
                _WORKERS["pool"].shutdown(wait=False)
            _WORKERS["pool"] = ThreadPoolExecutor(threads - 1, thread_name_prefix="refimpl-loop")
            _WORKERS["size"] = threads - 1
        pool = _WORKERS["pool"]
    queue, lock, failed = iter(tasks), threading.Lock(), threading.Event()

    def worker() -> None:
        _IN_WORKER.active = True
        try:
            mine = buffers()
            while not failed.is_set():
                with lock:
                    task = next(queue, _DONE)
                if task is _DONE:
                    return
                work(task, mine)
        except BaseException:
            failed.set()  # the other threads stop at their next task
            raise
        finally:
            _IN_WORKER.active = False

    with _BLAS:
        futures = [pool.submit(worker) for _ in range(threads - 1)]
        try:
            worker()  # the calling thread's share
            own = None
        except BaseException as error:  # noqa: BLE001 (raised below, once the other threads have stopped)
            own = error
        errors = [own, *(future.exception() for future in futures)]  # waits for every thread
    for error in errors:
        if error is not None:
            raise error


#: Entries of a call's first array from which `on_own_threads` holds the BLAS at one thread (some million: the
#: benchmark layer's input has four million; a layer of the tests or the training studies has far fewer).
HELD_FROM = 1 << 20


def on_own_threads(function: Callable[..., Any]) -> Callable[..., Any]:
    r"""Run `function` with NumPy's BLAS held at one thread, its parallel work on the loops' threads alone.

    A layer's step mixes two kinds of parallel work: large products, which
    NumPy hands to its BLAS's threads, and the loops of this module, which run
    on threads of their own. An OpenBLAS thread does not sleep when its
    product is done: it spins, waiting for the next one, for some $2^{28}$
    clock ticks (a tenth of a second) before it blocks. A loop that starts
    within that time shares the cores with the spinning threads (at two
    threads on two cores, `benchmarks/profile_backward.py` times a step both
    ways). Under this
    decorator the BLAS stays at one thread for the whole call, the large
    products are shared among the loops' threads by `matmul`, and no BLAS
    thread is woken at all. The thread count is unchanged (`loop_threads`
    still reads the caller's setting); with `LOOP_THREADS = 1`, or a BLAS on
    one thread, the call runs as it would without the decorator, and so does
    a call whose first argument (the layer's input, or `dy`) has fewer than
    `HELD_FROM` entries: its products are too small to share among threads
    that must first be woken, and the BLAS's own spinning threads serve it
    better.
    """
    @functools.wraps(function)
    def held(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else None
        if not (ENABLED and getattr(first, "size", 0) >= HELD_FROM and loop_threads(2) > 1):
            return function(*args, **kwargs)
        with _BLAS:
            return function(*args, **kwargs)

    return held


#: Multiply-adds a product must have before `matmul` shares it among threads (some 67 million, a millisecond
#: on one core): below that, waking the threads that take the other blocks costs about what they save.
THREADED_PRODUCT = 1 << 26


#: Bytes of a product's result from which `matmul` takes it from the pool (256 KiB): above the C allocator's
#: first threshold (128 KiB) for memory it maps afresh for each array and gives back when the array is freed.
POOLED_PRODUCT = 1 << 18


def blas_flags_ignored() -> np.errstate:
    r"""The floating-point state the fast paths' products run in: the "invalid" flag left by the BLAS ignored.

    NumPy reads the processor's floating-point flags after each product and
    turns a raised "invalid" flag into `RuntimeWarning: invalid value
    encountered in matmul`. NumPy's OpenBLAS (0.3.31, Skylake-X kernels) has
    been seen to leave that flag raised after small products of finite
    operands, in one process and not in another running the same code on
    the same data: the worked examples that check a PyTorch port, run as
    notebooks beside other tests, printed dozens of such warnings, from the
    expert loops and from `matmul`, in some runs and not in others.
    The flag says nothing about the result there. Where a product's result
    really is invalid (an infinite operand times a zero one) it holds NaN,
    which the layer's finite checks name; a product of finite operands that
    is not finite has overflowed, and the "overflow" flag still warns.
    """
    return np.errstate(invalid="ignore")


def matmul(a: Any, b: Any) -> Any:
    r"""`a @ b`; for a large product of two NumPy matrices, its rows (or columns) shared among `loop_threads` threads.

    The output is cut into `loop_threads` blocks of rows, or of columns when
    it has more columns than rows (a weight's gradient, `[n, d]` from
    $m$ tokens: cutting its few rows would make every thread pack all of the
    long right operand), and each block is one product of the BLAS on one
    thread, written straight into its part of the result: each entry is
    still one row of `a` times one column of `b`, summed by the BLAS (the
    same sum a threaded BLAS would form; its rounding may differ from an
    unthreaded call's only where the BLAS blocks the sum differently).
    A result of `POOLED_PRODUCT` bytes or more comes from the pool of
    workspaces (`WORKSPACES`): a step makes some twenty such arrays of 0.5
    to 16 MB, and the C allocator may hand each of them freshly mapped
    memory that the kernel must zero at every step. On one thread the product is
    one call of the BLAS into that array. Anything else (other array
    libraries, other shapes, small products) is `a @ b` itself.
    Inside `on_own_threads` this is how the layer's large products use every
    thread without waking the BLAS's own.
    """
    if not (fast_path_applies(a, b) and a.ndim == 2 and b.ndim == 2 and a.shape[1] == b.shape[0]):
        return a @ b
    (m, k), n = a.shape, b.shape[1]
    if m * k * n < THREADED_PRODUCT:
        with blas_flags_ignored():
            return a @ b
    pooled = m * n * a.dtype.itemsize >= POOLED_PRODUCT
    # [m, n]: a large result in the memory of an earlier step's, once that one is let go of
    out = WORKSPACES.empty((m, n), a.dtype) if pooled else np.empty((m, n), dtype=a.dtype)
    threads = loop_threads(max(m, n) // 64)
    if threads == 1:
        with blas_flags_ignored():
            return np.matmul(a, b, out=out)
    by_rows = m >= n
    size = m if by_rows else n
    per_thread = -(-size // threads)
    step = -(-per_thread // 16) * 16  # whole blocks of 16 rows (or columns), one per thread
    blocks = [slice(start, min(start + step, size)) for start in range(0, size, step)]

    def block(part: slice, _: Any) -> None:
        with blas_flags_ignored():
            if by_rows:
                np.matmul(a[part], b, out=out[part])  # [rows, n]
            else:
                np.matmul(a, b[:, part], out=out[:, part])  # [m, columns]

    for_each_on_threads(blocks, block)
    return out


#: 64-bit words in each row of the matrix that `fingerprint` reads each block of an array as (4072 bytes). A
#: prime, so that two words share a column only when their distance is a multiple of it, which the lengths of
#: a weight's rows and matrices (powers of two, multiples of 32 or 384) rarely are.
FINGERPRINT_COLUMNS = 509

#: Rows of `FINGERPRINT_COLUMNS` words in a block of `fingerprint` (some 520 KB): a block is read from memory
#: once, for its column sums, and stays in the core's cache for its row sums.
FINGERPRINT_ROWS = 128


def fingerprint(value: np.ndarray) -> bytes:
    r"""A 32-byte fingerprint of an array's bytes that any change a training loop makes moves, at one read of them.

    `refimpl.layer.backward.stable_latent_moe_vjp` compares a weight's
    fingerprint at the forward and at `backward` to refuse gradients of
    weights that changed in between. A copy would double the weights' memory
    and a hash of every byte (SHA-256 at 0.4 to 2 GB/s) costs ten times or
    more what one read costs, so the array's bytes are summed instead, as integers:

    1. The bytes (C order; zero bytes pad the last row) are read as rows of
       `FINGERPRINT_COLUMNS` unsigned 64-bit words, and the rows are cut into
       blocks of `FINGERPRINT_ROWS`.
    2. For each block, the sum of each column and the sum of each row,
       modulo $2^{64}$: exact integers, so the smallest change of one entry
       moves its row's sum, whatever the other entries are.
    3. Each block's $509 + 128$ sums are hashed (SHA-256, about 1 % of the
       array's bytes), and the blocks' hashes with the dtype and shape.

    So the fingerprint stays the same only if every row sum and every column
    sum of every block stays the same (or SHA-256 collides). Whatever the
    dtype, that catches:

    * any change of at most three 64-bit words: any one entry changed, by
      however little, or the signs of any one, two or three entries flipped.
      A row or a column holding one changed word moves (a word that changed
      moved by a nonzero amount modulo $2^{64}$), and three words cannot
      each share their row and their column with another one.
    * any two different words swapped: they lie in different rows or in
      different columns, whose sums both move. Two rows of a matrix or two
      experts' matrices swapped are many words moved, and are seen unless
      the words moved into every row and column of a block add up to those
      that left it.
    * a contiguous part of the array (the whole array, one expert's matrix,
      a row) multiplied by $-1$: each float64 word moves by $2^{63}$, each
      float32 word by $2^{63} \pm 2^{31}$ (or by one of the two, at an end of
      the part where one of its entries is outside). A part of a block
      shorter than two of its rows leaves a column with one changed word; a
      longer one changes a whole row, whose sum moves: the float64 moves add
      up to $509 \cdot 2^{63}$, which is $2^{63}$ modulo $2^{64}$ (509 is
      odd), the float32 ones to $2^{63}$ plus an odd multiple of $2^{31}$ (the
      509 low halves each move up or down), and a lone half at the part's end
      does not cancel either.
    * the array, or a part, multiplied by a positive factor other than 1:
      every entry's magnitude grows (or every one shrinks), so every changed
      word moves the same way, and a sum stays the same only when its words'
      moves add up to a multiple of $2^{64}$. For a power of two, $2^j$, with
      the entries staying normal, each nonzero float64 entry moves by
      $j\,2^{52}$, so a sum of $c$ of them stays only when $jc$ is a multiple
      of $2^{12}$: never for a row of 509 nonzero entries, nor for a column
      with one. Each nonzero float32 entry in the low half of a word (at an
      even index, on a little-endian machine) moves by $j\,2^{23}$ and each
      in the high half by $j\,2^{55}$: a row or column with one of the first
      kind always moves, since fewer than $2^{32} / |j|$ of them cannot add
      up to a multiple of $2^{32}$.

    What it cannot see is a change that keeps every row and column sum of
    every block modulo $2^{64}$: two equal words swapped (no change at all),
    four words at the corners of a rectangle of one block (words $p$,
    $p + a$, $p + 509t$ and $p + 509t + a$ of the block, $a < 509$) rearranged
    so that each of their two rows and two columns keeps its sum, such as
    the signs of four such float64 entries flipped, or a sum of many words'
    moves that happens to be a multiple of $2^{64}$ in every row and column a
    change touches. A multiplication by a negative factor other than $-1$
    moves each word by a sign flip and a magnitude change together, and is
    seen unless such a coincidence happens. The integer sums do not depend on
    their order, so the blocks run on `loop_threads` threads and the
    fingerprint is the same on any number of them.
    """
    raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8)  # [bytes]
    columns, row_bytes = FINGERPRINT_COLUMNS, 8 * FINGERPRINT_COLUMNS
    rows = -(-raw.size // row_bytes)  # the last one padded with zero bytes
    blocks = [(start, min(start + FINGERPRINT_ROWS, rows)) for start in range(0, rows, FINGERPRINT_ROWS)]
    digests = [b""] * len(blocks)

    def words(start: int, stop: int) -> np.ndarray:
        """Rows `start` to `stop` as a `[rows, columns]` matrix of words: a view, or a padded copy at the end."""
        part = raw[start * row_bytes:stop * row_bytes]
        if part.size == (stop - start) * row_bytes:
            return part.view(np.uint64).reshape(-1, columns)
        padded = np.zeros((stop - start) * row_bytes, dtype=np.uint8)
        padded[:part.size] = part
        return padded.view(np.uint64).reshape(-1, columns)

    def block(i: int, sums: tuple[np.ndarray, np.ndarray]) -> None:
        matrix = words(*blocks[i])  # [rows, columns]
        column_sums, row_sums = sums[0], sums[1][:matrix.shape[0]]
        np.add.reduce(matrix, axis=0, out=column_sums)  # modulo 2^64, exact in any order
        np.add.reduce(matrix, axis=1, out=row_sums)
        digest = hashlib.sha256(column_sums)
        digest.update(row_sums)
        digests[i] = digest.digest()

    for_each_on_threads(list(range(len(blocks))), block,
                        lambda: (np.empty(columns, dtype=np.uint64), np.empty(FINGERPRINT_ROWS, dtype=np.uint64)))
    whole = hashlib.sha256(f"{np.dtype(value.dtype).str} {tuple(value.shape)}".encode())
    for digest in digests:
        whole.update(digest)
    return whole.digest()


# ---------------------------------------------------------------------------
# The routed experts, in reused buffers
# ---------------------------------------------------------------------------

#: Entries of the combined output summed at a time (some 65,000): a block of tokens whose partial sum and
#: gathered rows stay in the core's own cache through all $k$ additions.
COMBINE_BLOCK = 1 << 16


def combine_in_buffers(sorted_rows: np.ndarray, position: np.ndarray) -> np.ndarray:
    """`refimpl.layer.latent_moe.combine` on NumPy: the same sums in the same order, a block of tokens at a time.

    For each block of tokens, each slot's rows are gathered into a buffer the
    size of the block and added to the block's sum while both are in cache;
    large outputs share their blocks among `loop_threads` threads (each
    token's sum is the same whatever block or thread computes it).
    """
    m, k = position.shape
    width = sorted_rows.shape[1]
    total = np.empty((m, width), dtype=sorted_rows.dtype)  # [m, width]
    step = max(1, COMBINE_BLOCK // max(1, width))
    blocks = [slice(start, start + step) for start in range(0, m, step)]

    def block(tokens: slice, rows: np.ndarray) -> None:
        where = position[tokens]  # [b, k]
        out = total[tokens]  # [b, width]
        np.take(sorted_rows, where[:, 0], axis=0, out=out)
        gathered = rows[:out.shape[0]]
        for r in range(1, k):
            out += np.take(sorted_rows, where[:, r], axis=0, out=gathered)

    for_each_on_threads(blocks, block, lambda: np.empty((step, width), dtype=sorted_rows.dtype))
    return total


def routed_experts_in_buffers(z: np.ndarray, dispatch: Any, w1: Any, w3: Any, w2: Any,
                              activation: tuple[Callable[..., Any], Callable[..., Any]], *, save: bool = False,
                              ) -> tuple[np.ndarray, dict[int, tuple] | None, np.ndarray]:
    r"""The loop of `refimpl.layer.latent_moe.routed_experts` for NumPy float32/float64: returns `(u, hidden, out_sorted)`.

    `dispatch` is the `refimpl.layer.latent_moe.Dispatch` of the route and
    `activation` the layer's pair `(glu(a, b), glu_and_grad(a, b, da))` of
    functions of the two products (`refimpl.layer.activations.expert_glu` and
    `expert_glu_and_grad` bound to the config, which run `glu_by_chunks` and
    `glu_and_grad_by_chunks` after any clamp the config asks for; `da` is
    where the gate's partial goes). Each expert's
    latents are gathered into one buffer sized for the busiest expert, its
    two products are written into two more (with `save=True`, into its rows
    of `[m*k, f]` arrays of the pool, `WORKSPACES`, which the backward
    reads, a third one taking the gate's partial), where the activation then runs in place, $p\,h$ is
    formed in another buffer, and the down-projection is written straight
    into its rows of the sorted output (`out=`, also from the pool). With `save=True` the activation's
    partials are kept per expert (`hidden[e] = (h, da, db)`) for the backward;
    the sorted output is returned so that the backward can reuse its memory.
    The experts run on `for_each_on_threads`'s threads, each with its own buffers.
    """
    dtype = z.dtype
    slots, f = dispatch.token.shape[0], w1.shape[1]
    out_sorted = WORKSPACES.empty((slots, w2.shape[1]), dtype)  # [m*k, l]
    experts = dispatch.experts()
    busiest = int(np.max(np.diff(dispatch.start))) if experts else 0
    # The two products: kept for the backward (as h and d_b phi), those of every slot in sorted order, [m*k, f]
    # each, from the pool; otherwise one expert's at a time, in each thread's buffers sized for the busiest expert.
    # With `save`, the gate's partial too: three arrays that the backward reads.
    kept_products = tuple(WORKSPACES.empty((slots, f), dtype) for _ in range(3)) if save else None
    hidden: dict[int, tuple] | None = {} if save else None
    glu, glu_and_grad = activation

    def buffers() -> tuple[np.ndarray, ...]:
        z_buf = np.empty((busiest, z.shape[1]), dtype=dtype)  # [m_e, l]
        ph_buf = np.empty((busiest, f), dtype=dtype)  # [m_e, f]
        products = kept_products or (*(np.empty((busiest, f), dtype=dtype) for _ in range(2)), None)  # [m_e, f] x2
        return z_buf, ph_buf, *products

    def expert(e: int, mine: tuple[np.ndarray, ...]) -> None:
        z_buf, ph_buf, gate_all, up_all, d_gate_all = mine
        rows = dispatch.rows(e)
        m_e = rows.stop - rows.start
        z_e, ph = z_buf[:m_e], ph_buf[:m_e]
        np.take(z, dispatch.token[rows], axis=0, out=z_e, mode="clip")  # [m_e, l]
        g_e, u_e, d_e = (np.asarray(w[e, ...], dtype=dtype) for w in (w1, w3, w2))  # [f,l] [f,l] [l,f]
        kept = rows if save else slice(0, m_e)
        with blas_flags_ignored():
            gate, up = np.matmul(z_e, g_e.T, out=gate_all[kept]), np.matmul(z_e, u_e.T, out=up_all[kept])
        if save:
            hidden[e] = glu_and_grad(gate, up, d_gate_all[rows])  # [m_e, f] x3
            h = hidden[e][0]
        else:
            h = glu(gate, up)  # [m_e, f]
        np.multiply(h, dispatch.weight[rows, :], out=ph)
        with blas_flags_ignored():
            np.matmul(ph, d_e.T, out=out_sorted[rows, :])  # [m_e, l]

    for_each_on_threads(experts, expert, buffers)
    return combine_in_buffers(out_sorted, dispatch.position), hidden, out_sorted


#: The forwards' saved records whose spent workspace a backward has taken (by `id`, each forgotten when its
#: record is freed), and the lock under which one is taken.
_WORKSPACES_TAKEN: set[int] = set()
_WORKSPACES_TAKEN_LOCK = threading.Lock()


def _take_saved_workspace(saved: Any) -> np.ndarray | None:
    """The forward's spent `[m*k, l]` buffer (`saved.workspace`) to the first backward that asks; None after.

    `backward` may be called more than once, and from several threads at
    once; each call writes its slots' latent gradients all over this scratch
    buffer, so two calls given the same one would write each other's rows.
    The first call takes it (a step's single backward then allocates
    nothing); every later or concurrent one gets None and takes a buffer of
    the pool (`WORKSPACES`). The record of which forwards gave theirs out
    lives here, not in `saved` (a frozen record of the forward), and each
    entry is dropped when its forward's record is freed.
    """
    if getattr(saved, "workspace", None) is None:
        return None
    key = id(saved)
    with _WORKSPACES_TAKEN_LOCK:
        if key in _WORKSPACES_TAKEN:
            return None
        _WORKSPACES_TAKEN.add(key)
    weakref.finalize(saved, _WORKSPACES_TAKEN.discard, key)  # before its id can be another record's
    return saved.workspace


def routed_experts_backward_in_buffers(z: np.ndarray, saved: Any, w1: Any, w3: Any, w2: Any, du: np.ndarray,
                            out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`refimpl.layer.backward.routed_experts_backward` for NumPy float32/float64, in a handful of reused buffers.

    The readable loop makes some fifteen fresh arrays per expert; at the
    benchmark size that is close to a gigabyte of short-lived memory per
    backward, which the allocator hands back to the system and faults in
    again, so the products run at half the speed they reach alone. Here every
    per-expert array is a slice of one of six buffers sized for the busiest
    expert, and the three weight gradients are written by their product
    straight into the stacks (`out=dw[e]`), zeroed only for experts without
    tokens. New stacks come from the pool (`WORKSPACES`): at the second step
    they are the memory of gradients the caller has let go of, not fresh
    pages. A transposed operand (`a.T` of a C-contiguous block) costs no
    copy: BLAS reads it with its transpose flag. With `out` (three stacks of
    the gradients' shapes and dtype) the gradients are written there. The
    experts run on `for_each_on_threads`'s threads, each with its own six buffers.
    The slots' latent gradients are written into the forward's spent sorted
    outputs (`saved.workspace`) by the first call only (`_take_saved_workspace`):
    a later call, or one running at the same time from another thread, takes
    its own from the pool.
    """
    dispatch = saved.dispatch
    (m, k), (n, ell, f) = dispatch.position.shape, w2.shape
    dtype = z.dtype
    workspace = _take_saved_workspace(saved)
    reuse = workspace is not None and workspace.dtype == dtype and workspace.shape == (m * k, ell)
    dz_sorted = workspace if reuse else WORKSPACES.empty((m * k, ell), dtype)  # [m*k, l]
    dp_sorted = WORKSPACES.empty((m * k,), dtype)  # [m*k]
    # New gradient stacks come from the pool: memory a caller let go of at an earlier step, never one it holds.
    dw1, dw3, dw2 = out if out is not None else (WORKSPACES.empty((n, f, ell), dtype),
                                                 WORKSPACES.empty((n, f, ell), dtype),
                                                 WORKSPACES.empty((n, ell, f), dtype))
    experts = dispatch.experts()
    idle = np.setdiff1d(np.arange(n), experts)
    dw1[idle], dw3[idle], dw2[idle] = 0, 0, 0
    busiest = int(np.max(np.diff(dispatch.start))) if experts else 0

    def buffers() -> tuple[np.ndarray, ...]:
        return (*(np.empty((busiest, ell), dtype=dtype) for _ in range(3)),  # z_e, du_e, lat: [m_e, l] each
                *(np.empty((busiest, f), dtype=dtype) for _ in range(3)))  # o_bar, a_bar, b_bar: [m_e, f] each

    def expert(e: int, mine: tuple[np.ndarray, ...]) -> None:
        rows = dispatch.rows(e)
        m_e = rows.stop - rows.start
        z_e, du_e, lat, o_bar, a_bar, b_bar = (buf[:m_e] for buf in mine)
        np.take(z, dispatch.token[rows], axis=0, out=z_e, mode="clip")  # [m_e, l]
        np.take(du, dispatch.token[rows], axis=0, out=du_e, mode="clip")  # [m_e, l]
        p_e = dispatch.weight[rows, :]  # [m_e, 1]
        h, dh_da, dh_db = saved.hidden[e]  # [m_e, f] each
        g_e, u_e, d_e = (np.asarray(w[e, ...], dtype=dtype) for w in (w1, w3, w2))  # [f,l] [f,l] [l,f]
        # Only the products ignore the BLAS's "invalid" flag; the steps between them warn as NumPy's own do.
        with blas_flags_ignored():
            np.matmul(du_e, d_e, out=o_bar)  # o_bar = du_e D_e
        np.einsum("tf,tf->t", o_bar, h, out=dp_sorted[rows])  # dp = o_bar . h, one pass and no temporary
        np.multiply(h, p_e, out=a_bar)
        with blas_flags_ignored():
            np.matmul(du_e.T, a_bar, out=dw2[e])  # dD_e = du_e^T (p h)
        o_bar *= p_e  # h_bar
        np.multiply(o_bar, dh_da, out=a_bar)
        np.multiply(o_bar, dh_db, out=b_bar)
        with blas_flags_ignored():
            np.matmul(a_bar.T, z_e, out=dw1[e])  # dG_e = a_bar^T z_e
            np.matmul(b_bar.T, z_e, out=dw3[e])  # dU_e = b_bar^T z_e
            np.matmul(a_bar, g_e, out=dz_sorted[rows])  # a_bar G_e
            np.matmul(b_bar, u_e, out=lat)  # b_bar U_e
        dz_sorted[rows] += lat  # a_bar G_e + b_bar U_e

    for_each_on_threads(experts, expert, buffers)
    dweights = np.take(dp_sorted, dispatch.position.reshape(m * k)).reshape(m, k)  # [m, k]
    return combine_in_buffers(dz_sorted, dispatch.position), dweights, dw1, dw3, dw2


def input_backward_in_one_product(h: np.ndarray, y_bar: np.ndarray, logit_bar: np.ndarray, z_bar: np.ndarray,
                                  shared: tuple[np.ndarray, np.ndarray, np.ndarray] | None, w_gate: np.ndarray,
                                  w_down: np.ndarray, gate_proj: np.ndarray, up_proj: np.ndarray,
                                  down_proj: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    r"""Stages 1, 3 and 8 of `refimpl.layer.backward.router_and_input_backward` on NumPy, the input's gradient as one product.

    The readable code adds four products for $\bar x$ (the router's, the
    down-projection's, the shared gate's and the shared up's), each a pass
    over an `[m, d]` array, and the router's has only $n$ terms per entry,
    too few for the BLAS to run at speed. Their sum is one product of
    concatenated operands,

    $$\bar x = [\bar z_r \,|\, \bar z \,|\, \bar a_s \,|\, \bar b_s]\,
    [W_r;\, W_\downarrow;\, G_s;\, U_s],$$

    with $n + \ell + 2 N_s f$ terms per entry, written once. The shared
    experts' $\bar a_s$, $\bar b_s$ are formed straight into their columns
    of the left operand (from the pool); the weight gradients are the same
    products as the readable code's, read from those columns. `h` `[m, d]`
    is the input, `y_bar` `[m, d]` the upstream gradient, `logit_bar` `[m, n]`
    and `z_bar` `[m, l]` the gradients in the router logits and the latent,
    `shared` the shared experts' saved `(h, da, db)` or None. Returns
    `(x_bar, grads)` with the router's, the down-projection's and the shared
    experts' weight gradients by name.
    """
    m, n, ell = h.shape[0], logit_bar.shape[1], z_bar.shape[1]
    width_s = gate_proj.shape[0] if shared is not None else 0
    left = WORKSPACES.empty((m, n + ell + 2 * width_s), h.dtype)  # [m, n + l + 2 N_s f]
    logit_cols, latent_cols = left[:, :n], left[:, n:n + ell]
    np.copyto(logit_cols, logit_bar)
    np.copyto(latent_cols, z_bar)
    grads = {"gate.weight": matmul(logit_cols.T, h),  # [n, d]
             "routed_expert_down_proj.weight": matmul(latent_cols.T, h)}  # [l, d]
    right = [w_gate, w_down]
    if shared is not None:
        hidden, dh_da, dh_db = shared  # [m, N_s f] each
        h_bar = matmul(y_bar, down_proj)  # [m, N_s f]
        a_bar = np.multiply(h_bar, dh_da, out=left[:, n + ell:n + ell + width_s])
        b_bar = np.multiply(h_bar, dh_db, out=left[:, n + ell + width_s:])
        grads["shared_experts.gate_proj.weight"] = matmul(a_bar.T, h)  # [N_s f, d]
        grads["shared_experts.up_proj.weight"] = matmul(b_bar.T, h)
        grads["shared_experts.down_proj.weight"] = matmul(y_bar.T, hidden)  # [d, N_s f]
        right += [gate_proj, up_proj]
    else:  # no shared experts: zero gradients of their (empty) weights
        grads.update({name: np.zeros(w.shape, dtype=h.dtype) for name, w in (
            ("shared_experts.gate_proj.weight", gate_proj), ("shared_experts.up_proj.weight", up_proj),
            ("shared_experts.down_proj.weight", down_proj))})
    x_bar = matmul(left, np.concatenate(right, axis=0))  # [m, d]
    return x_bar, grads


# ---------------------------------------------------------------------------
# Top-k and order statistics
# ---------------------------------------------------------------------------

def topk_by_partition(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """`refimpl._lib.xp.topk` on NumPy for `0 < k < n`: partition, then sort only the `k` survivors.

    O(n) per row plus a sort of k. Rows where the k-th value is tied with an
    unselected entry (where a partition may pick either) are redone with a
    stable sort, so the tie rule (the lower index first) holds there too.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])  # [rows, n]
    index = np.argpartition(x2, -k, axis=-1)[:, -k:]  # [rows, k], the k largest in arbitrary order
    values = np.take_along_axis(x2, index, axis=-1)
    kth = values.min(axis=-1, keepdims=True)  # [rows, 1]
    ambiguous = np.count_nonzero(x2 >= kth, axis=-1) > k  # [rows]
    if ambiguous.any():
        rows = np.flatnonzero(ambiguous)
        index[rows] = np.argsort(-x2[rows], axis=-1, kind="stable")[:, :k]
    # Order the survivors: by index first, then a stable sort by value descending.
    index.sort(axis=-1)
    values = np.take_along_axis(x2, index, axis=-1)
    order = np.argsort(-values, axis=-1, kind="stable")
    index = np.take_along_axis(index, order, axis=-1)
    values = np.take_along_axis(values, order, axis=-1)
    return values.reshape(*shape[:-1], k), index.reshape(*shape[:-1], k)


def _partition_select(part: np.ndarray, r: int, previous: bool) -> Any:
    """`np.partition` around position L - r (in place); the r - 1 entries right of it are the larger ones."""
    pos = part.shape[-1] - r
    part.partition(pos, axis=-1)
    kth = part[:, pos].copy()  # [p]
    return (kth, part[:, pos + 1:].min(axis=-1)) if previous else kth


def kth_largest_by_sampling(part: np.ndarray, r: int, previous: bool = False) -> Any:
    r"""`refimpl.balancing.kth_largest` on a C-contiguous NumPy scratch array `part` `[p, L]` (reordered in place).

    Row-wise selection with a sample that discards most entries first
    (Floyd and Rivest's idea). Partitioning costs several nanoseconds per
    entry, comparing well under one. When the wanted rank is near the top of
    long rows (Eq. 14 asks for about the $mk/n$-th largest of $m$ margins, the
    top 2% at K3's sizes), a strided sample of each row gives a value `low`
    that, with high probability, still has at least $r$ entries above it. One
    comparison pass keeps only the entries $\ge$ `low`, and the small
    candidate matrix is partitioned. A row where the sample was unlucky (fewer
    than $r$ kept) is redone with a plain partition, so the answer never
    depends on the sample.
    """
    p, length = part.shape
    stride = 16
    expected = r / stride  # sample entries expected among the r largest of a row
    t = math.ceil(expected + 4.0 * math.sqrt(expected) + 4.0)  # rank in the sample, with a safety margin
    if length < 64 * stride or t * stride > length // 4:
        return _partition_select(part, r, previous)
    sample = part[:, ::stride].copy()  # [p, L/16]
    low = _partition_select(sample, t, previous=False)  # [p], a lower bound for the r-th largest
    keep = part >= low[:, None]  # [p, L]
    count = keep.sum(axis=1)  # [p]
    # Each row's candidates packed to the left of a [p, width] matrix padded with -inf (at least r wide).
    width = max(int(count.max()), r)
    candidates = np.full((p, width), -np.inf, dtype=part.dtype)  # [p, width]
    row_of = np.repeat(np.arange(p), count)
    slot = np.arange(row_of.size) - np.repeat(np.cumsum(count) - count, count)
    candidates[row_of, slot] = part[keep]
    result = _partition_select(candidates, r, previous)
    unlucky = np.flatnonzero(count < r)  # the sample overestimated the bound: select on the full row
    if unlucky.size:
        redo = _partition_select(part[unlucky], r, previous)
        if previous:
            result[0][unlucky], result[1][unlucky] = redo
        else:
            result[unlucky] = redo
    return result


def kth_largest_cupy(x: Any, r: int, previous: bool = False) -> Any:
    """`refimpl.balancing.kth_largest` on CuPy, by its selection kernel.

    CuPy's partition runs a selection kernel only when the position it is
    asked for is small (it sorts whole rows otherwise), and the r-th largest
    sits near the end of a row. So it selects the r-th *smallest* of -x: the r
    smallest of -x come first, the r-th at position r - 1.
    """
    import cupy

    part = cupy.partition(-x, r - 1, axis=-1)  # [p, L]
    kth = -part[:, r - 1]
    return (kth, -part[:, :r - 1].max(axis=-1)) if previous else kth


# ---------------------------------------------------------------------------
# Eq. (14) by blocks of tokens
# ---------------------------------------------------------------------------

#: Tokens per block: the cutoffs read 4096 tokens' biased scores at a time, so the whole [m, n] matrix of
#: them is never allocated; the margins are transposed 256 tokens at a time, which keeps both the rows read
#: and the columns written in the cache.
CUTOFF_BLOCK = 4096
TRANSPOSE_BLOCK = 256


def cutoffs_by_blocks(scores: np.ndarray, bias: np.ndarray, top_k: int, *,
                      with_kth: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    r"""`refimpl.balancing.cutoffs` (and the $k$-th largest, $\kappa$) by blocks of `CUTOFF_BLOCK` tokens.

    NumPy pays for every fresh page of a half-gigabyte temporary; at K3's
    sizes that costs more than the arithmetic. The values are the same as
    the whole-array computation.
    """
    dtype = np.float64 if np.float64 in (scores.dtype, bias.dtype) else np.float32
    alphas, kappas = [], []
    for first in range(0, scores.shape[0], CUTOFF_BLOCK):
        biased = scores[first:first + CUTOFF_BLOCK].astype(dtype) + bias.astype(dtype)[None, :]  # [block, n]
        cut = kth_largest_by_sampling(biased, top_k + 1, previous=with_kth)
        alphas.append(cut[0] if with_kth else cut)
        kappas.append(cut[1] if with_kth else None)
    alpha = np.concatenate(alphas) if alphas else np.empty(0, dtype=dtype)  # [m]
    if not with_kth:
        return alpha
    return alpha, (np.concatenate(kappas) if kappas else np.empty(0, dtype=dtype))


def expert_major_margins_by_blocks(scores: np.ndarray, alpha: np.ndarray, bias: np.ndarray | None = None,
                                   kappa: np.ndarray | None = None) -> np.ndarray:
    """`refimpl.balancing.expert_major_margins` by blocks of `TRANSPOSE_BLOCK` tokens (NumPy transposes element by element)."""
    m, n = scores.shape
    s = scores.astype(alpha.dtype, copy=False)  # [m, n]
    out = np.empty((n, m), dtype=alpha.dtype)  # [n, m]
    for first in range(0, m, TRANSPOSE_BLOCK):
        rows = slice(first, min(m, first + TRANSPOSE_BLOCK))
        s_t = s[rows, :].T  # [n, block]
        margin_t = s_t - alpha[rows][None, :]  # [n, block]
        if kappa is not None:
            chosen_t = (s_t + bias.astype(alpha.dtype)[:, None]) > alpha[rows][None, :]  # [n, block]
            margin_t = np.where(chosen_t, margin_t, s_t - kappa[rows][None, :])
        out[:, rows] = margin_t
    return out


# ---------------------------------------------------------------------------
# Appendix D's scatter-add
# ---------------------------------------------------------------------------

#: Margins processed per pass of `histogram_count`: its work arrays (a few MB) then stay in cache.
PASS_MARGINS = 1 << 18


def histogram_count_by_experts(counts: np.ndarray, s: np.ndarray, alpha: np.ndarray, low: np.generic,
                    scale: np.generic) -> None:
    """The histogram's scatter-add of one chunk (`refimpl.balancing.histogram.BiasHistogram.add`) on NumPy, in place, by experts.

    Each pass takes a group of expert columns small enough that its work
    arrays stay in cache, and reuses the same buffers. The float operations
    are those of the readable path (subtract the low end from the cutoff,
    subtract the score, multiply, clip, then truncate, which is the floor for
    the non-negative clipped values), so both give identical bins.
    """
    c = s.shape[0]
    n, bins = counts.shape
    group = max(1, min(n, PASS_MARGINS // max(c, 1)))  # experts per pass
    # Ids fit in int32 unless the group holds 2^31 bins; int32 converts from float much faster than int64.
    id_dtype = np.int32 if group * bins < 2**31 else np.intp
    t_buffer = np.empty(c * group, dtype=alpha.dtype)
    id_buffer = np.empty(c * group, dtype=id_dtype)
    offset = np.arange(group, dtype=id_dtype) * bins  # [G], the first id of each expert in the group
    a = (alpha - low)[:, None]  # [c, 1]
    for j0 in range(0, n, group):
        g = min(group, n - j0)
        t = t_buffer[: c * g].reshape(c, g)  # [c, g]
        ids = id_buffer[: c * g].reshape(c, g)  # [c, g]
        np.subtract(a, s[:, j0:j0 + g], out=t)
        np.multiply(t, scale, out=t)
        np.clip(t, 0.0, float(bins - 1), out=t)
        np.copyto(ids, t, casting="unsafe")  # truncation toward zero: the floor, as t >= 0
        np.add(ids, offset[None, :g], out=ids)
        counts[j0:j0 + g] += np.bincount(id_buffer[: c * g], minlength=g * bins).reshape(g, bins)
