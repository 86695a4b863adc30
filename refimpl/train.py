r"""Training a small Stable LatentMoE language model, with the bias following the router.

Everything else in this package looks at one layer at a time, with fixed
weights. K3 calls its layer *Stable* because of what happens while the
weights move: activations inside the routed experts that grow, a routed sum
whose scale drifts with the chosen experts, and a load balance that must
track a router which changes every step. This module trains a model small
enough for two CPU cores so that all three can be watched.

**The model.** A byte-level language model: it reads the $c$ bytes before a
position and predicts the byte at it.

$$
h^{(0)} = \bigl[E_{t_{-c}}; \dots; E_{t_{-1}}\bigr] W_{\text{mix}}^\top,
\qquad
h^{(l)} = h^{(l-1)} + \operatorname{MoE}_l\!\bigl(\operatorname{RMSNorm}(h^{(l-1)}) \odot g_l\bigr),
$$

$$
\text{logits} = \bigl(\operatorname{RMSNorm}(h^{(L)}) \odot g_f\bigr) W_{\text{out}}^\top,
\qquad
\mathcal L = -\frac{1}{m}\sum_i \log \operatorname{softmax}(\text{logits}_i)_{y_i}.
$$

The byte embedding $E$ (`[256, e]`) is shared by the $c$ positions; the
$c$ embeddings are concatenated and mixed into the width $d$ by one matrix.
Each of the $L$ blocks is a pre-norm residual around one Stable LatentMoE
layer of Eq. (11), whose sizes and switches are one `MoEConfig`
(`TrainConfig.moe`; its `num_moe_layers` is $L$). There is no attention:
the context window is the whole memory, which keeps the model a pure test
bed for the MoE layer.

**The gradients.** Each block's layer runs once per step, by
`refimpl.backward.stable_latent_moe_vjp`: its forward pass gives the
output, the route and every intermediate, and its backward pass (derived by
hand on its own page) the gradients. The RMSNorms are
`refimpl.activations.rms_norm` and its backward, the same as the layer's
latent norm. The rest is small and written out here: the embedding and
mixing, the output layer and the cross-entropy. The optimizer is Adam.
The step asks a `Ranks` object every question whose answer needs more than
one process's arrays (the layer, a balancer's step, the loss of the batch,
its gradients, "is it finite?"); on one process the answers are the plain
computations, and over MPI `refimpl.train_parallel` gives the same answers
across ranks (below).

**The bias and the balancers.** The selection bias of each layer is not a
trained parameter: it never receives a gradient (it only chooses experts,
Eq. 13), and Adam never touches it. Each layer's bias is held by a
*balancer* (`refimpl.balancing.Balancer`), with next-step semantics: step
$t$ is routed with the bias computed from step $t-1$, and its own scores
give the bias of step $t+1$ (Eq. 14). The balancers are a table,
`BALANCERS`:

| name | rule |
|---|---|
| `qb` | exact Quantile Balancing, Eq. (14) (`QuantileBalancer`) |
| `qb-hist` | the histogram estimator of Appendix D, the batch split into micro-batches (`HistogramBalancer`) |
| `sign` | DeepSeek-V3's sign rule $b_j \leftarrow b_j + \gamma\,\operatorname{sign}(q - \text{load}_j)$ |
| `none` | the bias stays zero |
| `aux`, `seq` | an auxiliary balance loss (Switch's; DeepSeek's sequence-wise loss with the sign rule) |
| `capacity-1.0`, `capacity-1.25` | token dropping at a capacity |
| `hash` | hash routing on the byte being read |

The last five are the rules K3 is compared with (`refimpl.train_baselines`).
Every entry is a `Balancer` and the training step asks each one the same
questions, through one declared interface, and nothing else:

1. `balancer.layer_config(config.moe)`: the layer it balances (a capacity
   that drops, hash routing); computed once per step, and the layer that
   runs is this one, forward and backward;
2. `balancer.bias`: the bias that routes this step's batch;
3. `balancer.needs_token_ids`, or the layer's `hash_routing`: whether the
   layer is given the batch's token ids (the byte each position reads last);
4. `balancer.step(scores, index=route)`: after the layer has run, its own
   scores and route go to the balancer, which records the loads and computes
   the bias for the next batch;
5. `balancer.coefficient` and `balancer.auxiliary(scores, index)`: an
   auxiliary loss, whose gradient in the scores the layer's backward carries
   to the router and the layer's input (`backward(dy, dscores=...)`).

**What is measured.** Every step logs the loss and the *max violation*
$\max_j \text{load}_j / q - 1$, $q = mk/n$, of the route the layer made of
that step's batch with the bias in use at that step (the largest over the
layers, and each layer's). Every `stats_every` steps it also logs, per
layer, the largest routed-expert activation $\max |h|$ (the GLU output
inside the experts), the RMS of the routed sum $u$ before the latent norm,
and the norms of the gradients of the two latent projections. All of them
are read from the values the training step computed for the layer it
trained; nothing is run a second time.

**Precision.** `precision="float16"` or `"bfloat16"` emulates a
low-precision forward pass with `ml_dtypes`: the weights, each block's input
and output and the residual stream are rounded to that format (values past
its range become infinite), while the arithmetic, the gradients and Adam's
master weights stay in float32, as in mixed-precision training. The layer
itself computes in float32, so an overflow *inside* the experts cannot
happen in the emulation; the log therefore counts the steps whose largest
routed activation lies beyond the format's largest finite value (65,504 for
float16), which a kernel storing $h$ in that format would have turned into
infinities, and skips those steps as it skips a step whose loss or
gradients are not finite: that is what dynamic loss scaling does with an
infinity. (Only float16 has a range small enough for this to happen.)

**The data.** Real text that every machine has offline: a fixed list of
source files of the Python standard library (`CORPUS_FILES`), concatenated in
that order. Their sizes and SHA-256 digests are printed and logged, so a run
says exactly what it read; the last 5% of the bytes are held out for the
evaluation loss. Batches are $m$ positions drawn uniformly by the run's
random generator; the same seed gives the same losses, bit for bit.

## Training over MPI

`mpiexec -n P python -m refimpl.train --expert-parallel ...` trains the
same model with $P$ ranks: each holds $n/P$ experts of every layer, the
other parameters whole, and its own slice of every batch (every rank draws
the whole batch from the same generator and keeps its rows). The layers run
through `refimpl.expert_parallel.ep_vjp`, the replicated parameters'
gradients are summed over the ranks, the balancers' statistics are those of
the whole batch (the exact quantiles for `qb`, the histogram counts for
`qb-hist`, the loads for the sign rule), and every rank holds the same bias
and the same replicated weights, bit for bit. The losses are those of the
one-process run with the same seed and batch, to float32 rounding. Rank 0
writes the log, which adds each rank's load and time per stage to every
step (`rank_load`, `rank_seconds`) and sums them in `expert_parallel`. The
page "Training over MPI: the experts and the batch split between the ranks
of a job" (`refimpl.train_parallel`) says how each number is computed
across ranks, and what the ranks check before they exchange anything.
`--expert-parallel` started without `mpiexec` runs as one rank.

## Checkpoints

`train(config, checkpoint=DIR, checkpoint_every=N)` (the command's
`--checkpoint DIR --checkpoint-every N`) writes the complete state of the
run every $N$ steps and at the end, and `train(config, resume=DIR)`
(`--resume DIR`) continues it: the log of a resumed run is the log of the
run that was never interrupted, number for number (timings apart), on the
same machine with the same number of BLAS threads. The folder holds:

| file | holds |
|---|---|
| `latest.json` | `{"format": "refimpl.train checkpoint", "version": 1, "checkpoint": "step-00000005-…", "step": 5}`: which folder is the checkpoint |
| `step-00000005-…/manifest.json` | the configuration, the step, the corpus digest, the random generator's state (the data position), Adam's step, the counters of the log, and each file's size and SHA-256 |
| `…/params.npz` | every parameter of the model, float32, by name |
| `…/adam.npz` | Adam's moments, `m.<name>` and `v.<name>` |
| `…/balancer-<l>.npz` | layer $l$'s balancer, as `Balancer.save` writes it (kind, options, bias, history) |
| `…/log.json` | the log so far: every step's record and the time of each session |

Nothing in it needs pickle: arrays in `.npz` files and JSON (a
non-finite number in `log.json` is written as the string `"NaN"`,
`"Infinity"` or `"-Infinity"`). A checkpoint is written into a new folder
(`.step-…partial`), each file flushed to the disk, the folder renamed to
its final name, and only then is `latest.json` replaced (atomically) to
name it; the previous checkpoint's folder is removed after that. A run
killed at any moment therefore leaves `latest.json` naming a complete
checkpoint (or no `latest.json` at all, if it died before its first one),
and resuming checks every file against its digest. A checkpoint is resumed
only by the configuration that wrote it: any other field (the steps
apart) is refused, naming it.

## The command and what it promises

Run it as `python -m refimpl.train --balancer qb --steps 300 --seed 0 --out run.json`;
`python -m refimpl.train --help` lists the sizes and switches. Before it
allocates anything or trains a step it checks:

* every number (a negative seed, a size of 0, a `--batch` too small for
  the balancer, a NaN learning rate, a context longer than the held-out
  text, a model or batch that would not fit in this machine's memory): an
  error naming the flag, exit status 2;
* `--out`: not a folder, not under a regular file, in a folder it can
  write; an existing file is refused unless `--overwrite` is given;
* `--checkpoint`: a new or empty folder, or one holding a checkpoint (of
  this run when resuming, or any with `--overwrite`);
* `--resume`: a readable checkpoint, and no flag that contradicts it;
* with `--expert-parallel`: every rank checks its own arguments (rank 0
  alone checks `--out`, the file it writes), and the ranks then share their
  errors and compare their configurations, seed and corpus, so that every
  rank stops with the same message and status 2; the number of ranks must
  divide `--experts`, and `--checkpoint` and `--resume` are refused (they
  are for a run on one process). A rank that fails while training ends the
  whole job (`MPI_Abort`), so that no rank waits for ever in an exchange.

The log is written at the end, atomically (a temporary file in the same
folder, flushed, then renamed over the target, with the permissions the
umask gives), as strict JSON: a number that is not finite (the loss of a
diverged run) is `null`. If the write fails, the previous file is left
as it was. `--resume DIR` without `--checkpoint` goes on checkpointing into
`DIR`.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import numbers
import os
import re
import secrets
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, NoReturn

import ml_dtypes
import numpy as np

from ._files import fsync_folder, new_folder_mode, write_atomically
from .activations import expert_glu, rms_norm, rms_norm_backward
from .backward import stable_latent_moe_vjp
from .balancing import Balancer, BalanceStep, FrozenBalancer, QuantileBalancer, SignBalancer
from .config import MoEConfig
from .histogram import HistogramBalancer
from .latent_moe import MoEOutput, init_params, parameter_shapes, stable_latent_moe
from .routing import route, router_scores
from .train_baselines import AuxLossBalancer, CapacityBalancer, HashBalancer, SequenceLossBalancer

__all__ = [
    "BALANCERS",
    "CORPUS_FILES",
    "DEFAULT_LAYER",
    "PRECISIONS",
    "ONE_PROCESS",
    "Adam",
    "Checkpoint",
    "Corpus",
    "FrozenBalancer",
    "Ranks",
    "HistogramBalancer",
    "TrainConfig",
    "TrainConfigError",
    "check_resources",
    "cross_entropy",
    "default_layer",
    "load_corpus",
    "main",
    "noise_floor",
    "read_checkpoint",
    "rms_norm_vjp",
    "routed_activation_peak",
    "sample_batch",
    "train",
    "train_many",
    "write_log",
]

#: Bytes are the tokens: a vocabulary of 256.
VOCAB = 256

#: Floating formats the forward pass can be rounded to.
PRECISIONS: dict[str, Any] = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
}

#: The corpus: these standard-library source files, in this order (any that a Python lacks are skipped and
#: the run says so). About 0.7 MB of Python on CPython 3.11.
CORPUS_FILES: tuple[str, ...] = (
    "argparse.py", "ast.py", "collections/__init__.py", "dataclasses.py", "difflib.py", "fractions.py",
    "functools.py", "inspect.py", "json/decoder.py", "json/encoder.py", "pprint.py", "statistics.py",
    "string.py", "textwrap.py",
)

#: Share of the corpus held out for the evaluation loss (its last bytes).
HELD_OUT = 0.05


# ---------------------------------------------------------------------------
# The data
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Corpus:
    """The training text as bytes, and what it was read from.

    `data` is a `uint8` array of the concatenated files; `files` lists each
    file read as `(name, size, sha256)`; `missing` the listed files this
    Python does not have; `sha256` is the digest of `data`; `split` is the
    index where the held-out part begins.
    """

    data: np.ndarray
    files: tuple[tuple[str, int, str], ...]
    missing: tuple[str, ...]
    sha256: str
    split: int

    def describe(self) -> str:
        """A few lines saying exactly what was read."""
        lines = [f"corpus: {len(self.files)} standard-library files, {self.data.size:,} bytes, "
                 f"sha256 {self.sha256[:16]} (held out: the last {self.data.size - self.split:,} bytes)"]
        lines += [f"  {name:<26}{size:>9,} bytes  sha256 {digest[:16]}" for name, size, digest in self.files]
        if self.missing:
            lines.append(f"  not found on this Python: {', '.join(self.missing)}")
        return "\n".join(lines)

    def record(self) -> dict[str, Any]:
        """What the log says about the corpus: its digest, size, files read and files missing."""
        return {"sha256": self.sha256, "bytes": int(self.data.size),
                "files": [list(entry) for entry in self.files], "missing": list(self.missing)}


def load_corpus(root: str | Path | None = None, names: Sequence[str] = CORPUS_FILES) -> Corpus:
    """Read the corpus: the files `names` under `root` (default: this Python's standard library)."""
    root = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    if not root.is_dir():
        raise ValueError(f"root must be a directory holding the standard library sources, got {str(root)!r}")
    chunks, files, missing = [], [], []
    for name in names:
        path = root / name
        if not path.is_file():
            missing.append(name)
            continue
        text = path.read_bytes()
        chunks.append(text)
        files.append((name, len(text), hashlib.sha256(text).hexdigest()))
    joined = b"".join(chunks)
    if len(joined) < 10_000:
        raise ValueError(f"the corpus under {str(root)!r} holds only {len(joined)} bytes of the files {list(names)}; "
                         "at least 10,000 are needed")
    data = np.frombuffer(joined, dtype=np.uint8)
    return Corpus(data=data, files=tuple(files), missing=tuple(missing), sha256=hashlib.sha256(joined).hexdigest(),
                  split=int(len(joined) * (1.0 - HELD_OUT)))


def sample_batch(data: np.ndarray, rng: np.random.Generator, m: int, context: int) -> tuple[np.ndarray, np.ndarray]:
    """`m` training pairs drawn uniformly from `data`: the `context` bytes before a position, and its byte.

    Returns `tokens` `[m, context]` (int64) and `targets` `[m]` (int64).
    """
    position = rng.integers(context, data.size, size=m)  # [m]
    window = position[:, None] + np.arange(-context, 0)[None, :]  # [m, c]
    return data[window].astype(np.int64), data[position].astype(np.int64)


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------

#: The layer of the default run: d = 64, l = 32, n = 64 experts, k = 4, f = 32, one shared expert, two blocks,
#: SiTU-GLU and the latent norm (K3's switches).
DEFAULT_LAYER = MoEConfig(hidden_size=64, latent_size=32, num_experts=64, top_k=4, intermediate_size=32,
                          num_shared_experts=1, num_moe_layers=2)


def default_layer(**changes: Any) -> MoEConfig:
    """The default run's layer (`DEFAULT_LAYER`) with some `MoEConfig` fields changed, e.g. `num_experts=256`."""
    return DEFAULT_LAYER.replace(**changes)


class TrainConfigError(ValueError):
    """A `TrainConfig` value that cannot be trained; `field` names it (`"batch"`, `"moe.top_k"`, ...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


#: The fields of a record written before `TrainConfig` held a `MoEConfig`, and the layer's field each one was.
_FLAT_LAYER_FIELDS = {"d": "hidden_size", "latent": "latent_size", "experts": "num_experts", "top_k": "top_k",
                      "intermediate": "intermediate_size", "shared": "num_shared_experts",
                      "activation": "activation", "latent_norm": "use_latent_norm", "layers": "num_moe_layers"}


@dataclass(frozen=True)
class TrainConfig:
    r"""Everything a training run depends on; the defaults are the default run.

    `moe` is the `MoEConfig` of every block: its sizes ($d$, $\ell$, $n$,
    $k$, $f$, the shared experts), its switches (activation, latent norm)
    and, as `num_moe_layers`, the number of blocks $L$. A balancer may
    change the layer it balances (`Balancer.layer_config`: a capacity, hash
    routing). The rest is the model around the layers and the run:
    `context` $c$ bytes, `embed` $e$ the byte-embedding width, `batch` $m$
    tokens per step, `precision` the format the forward pass is rounded to.
    Optimizer: Adam with `lr`, `betas`, `eps`, gradients clipped to a global
    norm of `grad_clip` (0: no clipping). Balancing: `balancer` (a key of
    `BALANCERS`), the sign rule's `sign_rate` $\gamma$, the histogram's
    `bins` and `micro_batches`. Logging: statistics every `stats_every`
    steps, the held-out loss on `eval_batch` tokens every `eval_every`.

    `to_record()` is the form the log keeps; `TrainConfig.from_record` reads
    it back, and also reads the flat form of the logs recorded before the
    configuration held a `MoEConfig`.
    """

    balancer: str = "qb"
    steps: int = 300
    seed: int = 0
    precision: str = "float32"
    moe: MoEConfig = DEFAULT_LAYER
    context: int = 16
    embed: int = 16
    batch: int = 1024
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 0.0
    sign_rate: float = 1e-3
    bins: int = 1000
    micro_batches: int = 4
    stats_every: int = 10
    eval_every: int = 50
    eval_batch: int = 2048

    def __post_init__(self) -> None:
        def fail(name: str, message: str) -> NoReturn:
            raise TrainConfigError(name, f"{name} {message}")

        for name in ("steps", "context", "embed", "batch", "bins", "micro_batches", "stats_every", "eval_every",
                     "eval_batch", "seed"):
            value = getattr(self, name)
            low = 0 if name == "seed" else 1
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                fail(name, f"must be {'a non-negative' if low == 0 else 'a positive'} integer, got {value!r}")
            object.__setattr__(self, name, int(value))  # np.int64 and friends are stored as Python ints
        if self.seed >= 2**63:
            fail("seed", f"must be below 2**63, got {self.seed}")
        for name in ("lr", "eps", "sign_rate", "grad_clip"):
            value = getattr(self, name)
            low = "non-negative" if name == "grad_clip" else "positive"
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
                    or value < 0 or (value == 0 and name != "grad_clip"):
                fail(name, f"must be a {low} finite number{' (0: off)' if name == 'grad_clip' else ''}, "
                           f"got {value!r}")
            object.__setattr__(self, name, float(value))
        betas = tuple(self.betas) if isinstance(self.betas, (tuple, list)) else ()
        if len(betas) != 2 or not all(isinstance(beta, numbers.Real) and 0 <= beta < 1 for beta in betas):
            fail("betas", f"must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        if self.balancer not in BALANCERS:
            fail("balancer", f"must be one of {sorted(BALANCERS)}, got {self.balancer!r}")
        if self.precision not in PRECISIONS:
            fail("precision", f"must be one of {list(PRECISIONS)}, got {self.precision!r}")
        if not isinstance(self.moe, MoEConfig):
            raise TypeError(f"moe must be a MoEConfig (the layer of every block), got {type(self.moe).__name__}")
        if self.moe.top_k >= self.moe.num_experts:
            fail("moe.top_k", f"must be smaller than moe.num_experts={self.moe.num_experts} for balancing to mean "
                              f"anything, got {self.moe.top_k}")
        try:
            BALANCERS[self.balancer](self).check_batch(self.batch)
        except ValueError as exc:
            fail("batch", f"does not suit the balancer {self.balancer!r}: {exc}")

    @property
    def target_load(self) -> float:
        """$q = mk/n$ of one training batch."""
        return self.batch * self.moe.top_k / self.moe.num_experts

    def to_record(self) -> dict[str, Any]:
        """The configuration as plain JSON values, the layer's fields under `moe` (the log's `config`)."""
        record = asdict(self)
        record["betas"] = list(self.betas)
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> TrainConfig:
        """The `TrainConfig` of a log's `config`: the nested form of `to_record`, or the older flat form.

        The flat form (written before the configuration held a `MoEConfig`)
        names the layer's sizes `d`, `latent`, `experts`, `top_k`,
        `intermediate`, `shared`, `layers`, and its switches `activation`
        and `latent_norm`, all nine; every other field of the layer is the
        default of `MoEConfig`, as it was then.
        """
        if not isinstance(record, Mapping):
            raise TypeError(f"record must be a mapping (a log's config), got {type(record).__name__}")
        values = dict(record)
        flat = {name: values.pop(name) for name in list(values) if name in _FLAT_LAYER_FIELDS}
        if flat and "moe" in values:
            raise ValueError(f"record holds both a moe layer and the flat layer fields {sorted(flat)}")
        if "moe" in values:
            layer = values.pop("moe")
            if not isinstance(layer, Mapping):
                raise TypeError(f"record['moe'] must be a mapping of MoEConfig fields, got {type(layer).__name__}")
            strange = sorted(set(layer) - {f.name for f in fields(MoEConfig)})
            if strange:
                raise ValueError(f"record['moe'] holds fields that MoEConfig does not have: {strange}")
            values["moe"] = MoEConfig(**layer)
        elif flat:
            absent = sorted(set(_FLAT_LAYER_FIELDS) - set(flat))
            if absent:
                raise ValueError(f"a flat record names all the layer fields {sorted(_FLAT_LAYER_FIELDS)}; this "
                                 f"one lacks {absent}")
            values["moe"] = MoEConfig(**{_FLAT_LAYER_FIELDS[name]: value for name, value in flat.items()})
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"record holds fields that TrainConfig does not have: {unknown}")
        if "betas" in values:
            values["betas"] = tuple(values["betas"])
        return cls(**values)


# ---------------------------------------------------------------------------
# The balancers: a table of rules, each a `Balancer`
# ---------------------------------------------------------------------------

#: The balancers, by name: each entry builds one balancer for one layer from the run's configuration.
#: A new rule is one more entry whose object is a `refimpl.balancing.Balancer`.
BALANCERS: dict[str, Callable[[TrainConfig], Balancer]] = {
    "qb": lambda config: QuantileBalancer(config.moe.num_experts, config.moe.top_k),
    "qb-hist": lambda config: HistogramBalancer(config.moe.num_experts, config.moe.top_k, bins=config.bins,
                                                micro_batches=config.micro_batches),
    "sign": lambda config: SignBalancer(config.moe.num_experts, config.moe.top_k, rate=config.sign_rate),
    "none": lambda config: FrozenBalancer(config.moe.num_experts, config.moe.top_k),
    # The other balancers (refimpl.train_baselines): auxiliary losses, capacity with dropping, hash routing.
    "aux": lambda config: AuxLossBalancer(config.moe.num_experts, config.moe.top_k),
    "seq": lambda config: SequenceLossBalancer(config.moe.num_experts, config.moe.top_k, rate=config.sign_rate),
    "capacity-1.0": lambda config: CapacityBalancer(config.moe.num_experts, config.moe.top_k, capacity_factor=1.0),
    "capacity-1.25": lambda config: CapacityBalancer(config.moe.num_experts, config.moe.top_k,
                                                     capacity_factor=1.25),
    "hash": lambda config: HashBalancer(config.moe.num_experts, config.moe.top_k),
}


def _balancers(config: TrainConfig) -> list[Balancer]:
    """One fresh balancer per block."""
    return [BALANCERS[config.balancer](config) for _ in range(config.moe.num_moe_layers)]


# ---------------------------------------------------------------------------
# The small pieces and their gradients, by hand
# ---------------------------------------------------------------------------

def rms_norm_vjp(x: np.ndarray, g: np.ndarray, eps: float = 1e-5) -> tuple[np.ndarray, Callable]:
    r"""RMSNorm $y = x\,r \odot g$ with $r = (\overline{x^2} + \varepsilon)^{-1/2}$, and its backward pass.

    Returns `y` `[m, d]` and `backward(dy) -> (dx, dg)`: the package's one
    RMSNorm (`refimpl.activations.rms_norm`) and its one backward
    (`rms_norm_backward`), paired. With $a = dy \odot g$:

    $$
    \frac{\partial \mathcal L}{\partial x} = r\,a - \frac{r^3}{d}\,x\,(a \cdot x),
    \qquad
    \frac{\partial \mathcal L}{\partial g} = \sum_i dy_i \odot x_i\,r_i .
    $$
    """
    y = rms_norm(x, g, eps)  # [m, d]

    def backward(dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return rms_norm_backward(x, g, dy, eps)  # [m, d], [d]

    return y, backward


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
    r"""Mean cross-entropy of `logits` `[m, V]` against `targets` `[m]`, and its gradient `[m, V]`.

    $$
    \mathcal L = \frac1m \sum_i \Bigl(\log \sum_v e^{z_{iv}} - z_{i y_i}\Bigr),
    \qquad
    \frac{\partial \mathcal L}{\partial z_{iv}} = \frac{\operatorname{softmax}(z_i)_v - [v = y_i]}{m}.
    $$
    """
    m = logits.shape[0]
    shifted = logits - logits.max(axis=1, keepdims=True)  # [m, V], the largest at 0: no overflow
    log_total = np.log(np.sum(np.exp(shifted), axis=1))  # [m]
    picked = shifted[np.arange(m), targets]  # [m]
    loss = float(np.mean(log_total - picked))
    # $$\operatorname{softmax}(z_i) - \mathbf 1_{y_i}$$, divided by m for the mean
    dlogits = np.exp(shifted - log_total[:, None])  # [m, V]
    dlogits[np.arange(m), targets] -= 1.0
    return loss, dlogits / m


class Adam:
    r"""Adam with bias correction, over a dict of float32 arrays.

    $$
    m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,\quad
    \theta_t = \theta_{t-1} - \eta\,\frac{m_t / (1-\beta_1^t)}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon}.
    $$

    Only the names given at construction are trained; the selection biases are
    left out, since the balancer sets them. Its state is `t` and the moments
    `m`, `v` (dicts of arrays), which a checkpoint saves.
    """

    def __init__(self, names: Sequence[str], params: Mapping[str, np.ndarray], lr: float,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> None:
        self.names = list(names)
        self.lr, self.betas, self.eps = lr, betas, eps
        self.t = 0
        self.m = {name: np.zeros_like(params[name]) for name in self.names}
        self.v = {name: np.zeros_like(params[name]) for name in self.names}

    def step(self, params: dict[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> None:
        """Update `params` in place from `grads`."""
        self.t += 1
        beta1, beta2 = self.betas
        correction1, correction2 = 1.0 - beta1**self.t, 1.0 - beta2**self.t
        for name in self.names:
            g = grads[name]
            self.m[name] = beta1 * self.m[name] + (1.0 - beta1) * g
            self.v[name] = beta2 * self.v[name] + (1.0 - beta2) * (g * g)
            # $$\theta \leftarrow \theta - \eta\,\hat m / (\sqrt{\hat v} + \epsilon)$$
            update = (self.m[name] / correction1) / (np.sqrt(self.v[name] / correction2) + self.eps)
            params[name] = (params[name] - self.lr * update).astype(np.float32)


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------

BIAS = "gate.e_score_correction_bias"


def _moe_prefix(layer: int) -> str:
    return f"layers.{layer}.moe."


def model_shapes(config: TrainConfig) -> dict[str, tuple[int, ...]]:
    """The name and shape of every parameter of the model, in the order `init_model` draws them."""
    d, c, e = config.moe.hidden_size, config.context, config.embed
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (VOCAB, e), "mix.weight": (d, c * e)}
    for layer in range(config.moe.num_moe_layers):
        shapes[f"layers.{layer}.norm.weight"] = (d,)
        shapes.update({_moe_prefix(layer) + name: shape for name, shape in parameter_shapes(config.moe).items()})
    shapes["norm.weight"] = (d,)
    shapes["out.weight"] = (VOCAB, d)
    return shapes


def init_model(config: TrainConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random float32 weights of the whole model, in one flat dict of named arrays.

    Names: `embed.weight` `[256, e]`, `mix.weight` `[d, c e]`, per layer `l`
    `layers.l.norm.weight` `[d]` and `layers.l.moe.<HF name>` (the layer of
    `init_params`), `norm.weight` `[d]`, `out.weight` `[256, d]`.
    """
    d, c, e = config.moe.hidden_size, config.context, config.embed
    params: dict[str, np.ndarray] = {
        "embed.weight": rng.standard_normal((VOCAB, e)).astype(np.float32),
        "mix.weight": (rng.standard_normal((d, c * e)) / np.sqrt(c * e)).astype(np.float32),
    }
    for layer in range(config.moe.num_moe_layers):
        params[f"layers.{layer}.norm.weight"] = np.ones(d, dtype=np.float32)
        for name, value in init_params(config.moe, rng).items():
            params[_moe_prefix(layer) + name] = value
    params["norm.weight"] = np.ones(d, dtype=np.float32)
    params["out.weight"] = (rng.standard_normal((VOCAB, d)) / np.sqrt(d)).astype(np.float32)
    return params


def _layer_params(params: Mapping[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    prefix = _moe_prefix(layer)
    return {name[len(prefix):]: value for name, value in params.items() if name.startswith(prefix)}


def _rounded(x: np.ndarray, precision: str) -> np.ndarray:
    """`x` rounded to the precision's format and back to float32 (overflow becomes infinity)."""
    if precision == "float32":
        return x
    with np.errstate(over="ignore"):
        return x.astype(PRECISIONS[precision]).astype(np.float32)


def routed_activation_peak(z: np.ndarray, index: np.ndarray, w1: np.ndarray, w3: np.ndarray,
                           config: MoEConfig) -> float:
    r"""The largest $|h|$ inside the routed experts: $h = \operatorname{GLU}(z G_e^\top, z U_e^\top)$ of every chosen pair.

    `z` `[m, l]` is the latent, `index` `[m, k]` the route. This is the
    activation that SiTU-GLU bounds by $\beta_1 \beta_2 = 100$ and SwiGLU
    does not. The training step reads the same value off the layer's own
    forward pass (`RoutedActivations.peak`); this function computes it from
    scratch, for a layer outside a training step.
    """
    peak = 0.0
    for e in np.unique(index).tolist():
        rows = np.flatnonzero(np.any(index == e, axis=1))  # the tokens that chose expert e
        z_e = z[rows]  # [m_e, l]
        h = expert_glu(z_e @ w1[e].T, z_e @ w3[e].T, config)  # [m_e, f]
        peak = max(peak, float(np.max(np.abs(h))))
    return peak


#: A layer with its backward, as a training step calls it: `layer_vjp(x [m, d], params, config, token_ids)`
#: returns the layer's `MoEOutput` (with the route and the intermediates) and its `backward(dy, dscores=None)
#: -> (dx, dparams)`.
LayerVJP = Callable[[np.ndarray, Mapping[str, np.ndarray], MoEConfig, "np.ndarray | None"],
                    tuple[MoEOutput, Callable[..., tuple[Any, Mapping[str, Any]]]]]


def single_process_layer(x: np.ndarray, params: Mapping[str, np.ndarray], config: MoEConfig,
                         token_ids: np.ndarray | None) -> tuple[MoEOutput, Callable]:
    """The layer on one process: `stable_latent_moe_vjp`, keeping every intermediate."""
    return stable_latent_moe_vjp(x, params, config, token_ids=token_ids, return_intermediates=True)


class Ranks:
    r"""The processes a training step runs on; this class is one process, holding the whole batch and every expert.

    The training step (`forward_backward`), the evaluation and the loop ask
    this object every question whose answer depends on more than what one
    process holds, and nothing else differs between one process and many:

    * `shard(params)`: the part of the model's parameters this process keeps;
      `rows(m)`: its slice of a batch of `m` tokens;
    * `layer_vjp(x, params, config, token_ids) -> (MoEOutput, backward)`: the
      layer with its route and intermediates, and `backward(dy, dscores=None)
      -> (dx, dparams)`; `layer(x, params, config, token_ids) -> y`: the
      layer's forward alone (the evaluation);
    * `balance(balancer, scores, index, token_ids) -> BalanceStep`: the
      balancer's step on the whole batch, and `auxiliary(balancer, scores,
      index) -> (value, dscores)`: its auxiliary loss of the whole batch and
      the gradient in these rows' scores;
    * `all(flag)`, `max(value)`, `mean(values)`: a condition, a largest
      value and a mean over the whole batch; `cross_entropy(logits,
      targets)`: the mean loss of the whole batch and the gradient of these
      rows' logits;
    * `gradients(grads)`: the whole batch's gradients from these rows'
      (`sum_of_squares(grads)`: of all of them, for the global norm);
    * `step_record()`: what the step's log record adds (nothing here).

    Here each answer is the plain computation on the process's own arrays.
    `refimpl.train_parallel.ExpertParallel` answers the same questions
    across the ranks of an MPI job, each rank with its slice of the batch
    and its block of experts; `size` and `rank` say how many processes there
    are and which one this is.
    """

    rank, size = 0, 1

    def shard(self, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return params

    def rows(self, m: int) -> slice:
        return slice(0, m)

    def layer_vjp(self, x: np.ndarray, params: Mapping[str, np.ndarray], config: MoEConfig,
                  token_ids: np.ndarray | None) -> tuple[MoEOutput, Callable]:
        return single_process_layer(x, params, config, token_ids)

    def layer(self, x: np.ndarray, params: Mapping[str, np.ndarray], config: MoEConfig,
              token_ids: np.ndarray | None) -> np.ndarray:
        return stable_latent_moe(x, params, config, token_ids=token_ids)

    def balance(self, balancer: Balancer, scores: np.ndarray, index: np.ndarray,
                token_ids: np.ndarray | None) -> BalanceStep:
        return balancer.step(scores, index=index, token_ids=token_ids)

    def auxiliary(self, balancer: Balancer, scores: np.ndarray, index: np.ndarray) -> tuple[float, np.ndarray]:
        return balancer.auxiliary(scores, index)

    def all(self, flag: bool) -> bool:
        return bool(flag)

    def max(self, value: float) -> float:
        return value

    def mean(self, values: np.ndarray) -> float:
        return float(np.mean(values))

    def cross_entropy(self, logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
        return cross_entropy(logits, targets)

    def gradients(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return grads

    def sum_of_squares(self, grads: Mapping[str, np.ndarray]) -> float:
        return sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values())

    def step_record(self) -> dict[str, Any]:
        return {}


#: The one process of a run that is not distributed.
ONE_PROCESS = Ranks()


def _router_underflowed(x: np.ndarray, weight: np.ndarray, config: MoEConfig) -> bool:
    """Whether some router score of `x` underflowed to exactly 0 (asked only after the layer refused its input)."""
    return bool(np.any(router_scores(x, weight, config.score_function) == 0))


@dataclass
class StepResult:
    """What one forward and backward pass computed (before the optimizer step)."""

    loss: float
    grads: dict[str, np.ndarray]
    violations: list[float]
    stats: dict[str, list[float]] = field(default_factory=dict)
    balancing: dict[str, list[float]] = field(default_factory=dict)  # per layer: aux_loss, drop_rate


def forward_backward(params: dict[str, np.ndarray], tokens: np.ndarray, targets: np.ndarray,
                     balancers: Sequence[Balancer], config: TrainConfig, *,
                     with_stats: bool = False, ranks: Ranks = ONE_PROCESS,
                     layer_vjp: LayerVJP | None = None) -> StepResult:
    """One training step's loss and gradients; each layer's balancer reads the layer's route and moves to its next bias.

    Each block runs the layer its balancer asks for (`layer_config`), once,
    forward and backward, through `ranks.layer_vjp` (or `layer_vjp`, if
    given: a test records the layer's calls through it). The bias written into
    `params` before a layer runs is the balancer's held bias, computed from
    the previous step; the balancer then reads this step's scores and the
    layer's route for the next one. The statistics are read off the values
    this pass computed.

    `tokens` and `targets` are this process's rows of the batch, and
    `ranks` says where the rest is (`Ranks`, the default: nowhere, one process;
    `refimpl.train_parallel.ExpertParallel`: on the other ranks); the loss,
    the loads, the statistics and the gradients returned are those of the
    whole batch.
    """
    precision = config.precision
    eps = config.moe.rms_norm_eps
    m, c = tokens.shape
    q = config.target_load
    # The layer each balancer balances, once per step.
    layers = [balancer.layer_config(config.moe) for balancer in balancers]
    # Embedding: $$h^{(0)} = [E_{t_{-c}}; \dots; E_{t_{-1}}]\, W_{\text{mix}}^\top$$
    embedded = params["embed.weight"][tokens].reshape(m, c * config.embed)  # [m, c e]
    w_mix = _rounded(params["mix.weight"], precision)
    h = _rounded(embedded @ w_mix.T, precision)  # [m, d]
    backs, violations = [], []
    stats: dict[str, list[float]] = {"activation_peak": [], "routed_rms": []}
    balancing: dict[str, list[float]] = {}
    token_ids = tokens[:, -1]  # [m], the byte each position reads last (what hash routing keys on)
    auxiliary_total = 0.0
    for number, (balancer, layer) in enumerate(zip(balancers, layers, strict=True)):
        # Pre-norm: $$a = \operatorname{RMSNorm}(h) \odot g_l$$
        g = params[f"layers.{number}.norm.weight"]
        a = _rounded(rms_norm(h, g, eps), precision)  # [m, d]
        layer_params = {name: (value if name == BIAS else _rounded(value, precision))
                        for name, value in _layer_params(params, number).items()}
        # A forward pass that overflowed (an infinite input or router weight): no step.
        if not ranks.all(np.all(np.isfinite(a)) and np.all(np.isfinite(layer_params["gate.weight"]))):
            return StepResult(math.nan, {}, [math.nan] * len(balancers))
        # Route with the bias held from the previous step: the layer runs once, forward and backward.
        layer_params[BIAS] = params[_moe_prefix(number) + BIAS] = balancer.bias
        ids = token_ids if (layer.hash_routing or balancer.needs_token_ids) else None
        try:
            out, moe_back = (ranks.layer_vjp if layer_vjp is None else layer_vjp)(a, layer_params, layer, ids)
        except ValueError:
            # A diverged router whose scores underflowed to 0 (the layer refuses weights of 0/0): no step.
            # (Only on one process: across ranks, the others are waiting in the layer's exchange, and the
            # error ends the job.)
            if ranks.size == 1 and _router_underflowed(a, layer_params["gate.weight"], layer):
                return StepResult(math.nan, {}, [math.nan] * len(balancers))
            raise
        # The balancer reads the layer's scores and route, and computes the next bias.
        step = ranks.balance(balancer, out.scores, out.index, ids)
        # $$\max_j \text{load}_j / q - 1$$
        violations.append(float(step.load.max() / q - 1.0))
        # An auxiliary loss on the router scores: its value now, its gradient through the layer's backward.
        dscores = None
        if balancer.coefficient:
            value, grad = ranks.auxiliary(balancer, out.scores, out.index)
            auxiliary_total += balancer.coefficient * value
            dscores = balancer.coefficient * grad  # [m, n]
            balancing.setdefault("aux_loss", []).append(value)
        if out.kept is not None:
            balancing.setdefault("drop_rate", []).append(1.0 - ranks.mean(out.kept))
        if with_stats:
            stats["activation_peak"].append(ranks.max(out.routed.peak()))
            stats["routed_rms"].append(float(np.sqrt(ranks.mean(np.asarray(out.u, dtype=np.float64) ** 2))))
        # Residual: $$h^{(l)} = h^{(l-1)} + \operatorname{MoE}_l(a)$$
        backs.append((h, g, moe_back, dscores))
        h = _rounded(h + _rounded(np.asarray(out.y), precision), precision)
    # Output: $$z = (\operatorname{RMSNorm}(h^{(L)}) \odot g_f)\, W_{\text{out}}^\top$$
    a_f = _rounded(rms_norm(h, params["norm.weight"], eps), precision)  # [m, d]
    w_out = _rounded(params["out.weight"], precision)
    logits = a_f @ w_out.T  # [m, 256]
    with np.errstate(invalid="ignore", over="ignore"):
        loss, dlogits = ranks.cross_entropy(logits, targets)
    if not math.isfinite(loss):
        return StepResult(loss, {}, violations, stats, balancing)

    # ---- backward: the same path in reverse ----
    grads: dict[str, np.ndarray] = {}
    # $$\partial W_{\text{out}} = \partial z^\top a_f, \qquad \partial a_f = \partial z\, W_{\text{out}}$$
    grads["out.weight"] = dlogits.T @ a_f  # [256, d]
    dh, grads["norm.weight"] = rms_norm_backward(h, params["norm.weight"], dlogits @ w_out, eps)  # [m, d], [d]
    for number in reversed(range(len(balancers))):
        if not ranks.all(np.all(np.isfinite(dh))):
            # The gradient overflowed on its way back: no update this step, as for a non-finite loss
            # (the statistics keep the gradient norms of the layers above, which were finite).
            if with_stats:
                _gradient_norms(ranks.gradients(grads), config, stats)
            return StepResult(loss, {}, violations, stats, balancing)
        h_in, g, moe_back, dscores = backs[number]
        # The residual passes $\partial h$ through and adds the block's path; an auxiliary loss adds its
        # gradient in the scores, which the layer's backward carries to the router and the input.
        da, dmoe = moe_back(dh, dscores=dscores)  # [m, d], the layer's parameter gradients
        for name, value in dmoe.items():
            grads[_moe_prefix(number) + name] = np.asarray(value)
        dx, grads[f"layers.{number}.norm.weight"] = rms_norm_backward(h_in, g, np.asarray(da), eps)
        dh = dh + dx  # [m, d]
    # $$\partial W_{\text{mix}} = \partial h^{(0)\top} [E], \qquad \partial [E] = \partial h^{(0)} W_{\text{mix}}$$
    grads["mix.weight"] = dh.T @ embedded  # [d, c e]
    dembedded = (dh @ w_mix).reshape(m * c, config.embed)  # [m c, e]
    # Each byte's embedding gathers the gradient of every place it was read (a scatter-add).
    grads["embed.weight"] = np.zeros_like(params["embed.weight"])
    np.add.at(grads["embed.weight"], tokens.reshape(m * c), dembedded)
    # The gradients of the whole batch (on one process: these already are).
    grads = ranks.gradients(grads)
    if with_stats:
        _gradient_norms(grads, config, stats)
    grads = {name: value.astype(np.float32) for name, value in grads.items()}
    if auxiliary_total:
        balancing["objective"] = [loss + auxiliary_total]  # what the gradient is of; `loss` stays the LM loss
    return StepResult(loss, grads, violations, stats, balancing)


def _gradient_norms(grads: Mapping[str, np.ndarray], config: TrainConfig, stats: dict[str, list[float]]) -> None:
    """Add to `stats` the norms of the two latent projections' gradients of every layer `grads` holds, in order."""
    if not config.moe.use_latent_projection:
        return
    for name, key in (("routed_expert_down_proj.weight", "grad_norm_down"),
                      ("routed_expert_up_proj.weight", "grad_norm_up")):
        names = [_moe_prefix(number) + name for number in range(config.moe.num_moe_layers)]
        norms = [float(np.linalg.norm(grads[name])) for name in names if name in grads]
        if norms:
            stats[key] = norms


def evaluate(params: Mapping[str, np.ndarray], tokens: np.ndarray, targets: np.ndarray,
             config: TrainConfig, layers: Sequence[MoEConfig] | None = None, *,
             ranks: Ranks = ONE_PROCESS) -> float:
    """The loss on held-out tokens with the biases frozen as they are (inference: no quantile is computed).

    `layers` are the blocks' layers as the balancers give them (default:
    `config.moe` in every block); a capacity is not applied at evaluation,
    where nothing is dropped. `tokens`, `targets` and `ranks` are as in
    `forward_backward`: the loss is that of the whole held-out batch.
    """
    eps = config.moe.rms_norm_eps
    layers = [config.moe] * config.moe.num_moe_layers if layers is None else layers
    m, c = tokens.shape
    h = params["embed.weight"][tokens].reshape(m, c * config.embed) @ params["mix.weight"].T  # [m, d]
    for number, layer in enumerate(layers):
        a = rms_norm(h, params[f"layers.{number}.norm.weight"], eps)
        if not ranks.all(np.all(np.isfinite(a))):
            return math.nan  # a model that has diverged: its activations overflow
        served = layer.replace(capacity_factor=None)
        ids = tokens[:, -1] if served.hash_routing else None
        layer_params = _layer_params(params, number)
        try:
            h = h + np.asarray(ranks.layer(a, layer_params, served, ids))
        except ValueError:
            if ranks.size == 1 and _router_underflowed(a, layer_params["gate.weight"], served):
                return math.nan  # a diverged router, whose weights would be 0/0
            raise
    a_f = rms_norm(h, params["norm.weight"], eps)
    loss, _ = ranks.cross_entropy(a_f @ params["out.weight"].T, targets)
    return loss


# ---------------------------------------------------------------------------
# What a run needs: text longer than its context, memory for its arrays
# ---------------------------------------------------------------------------

def _memory_parts(config: TrainConfig) -> list[tuple[str, str, int]]:
    """The largest arrays of a run, roughly: `(field to blame, what they are, bytes)`."""
    moe = config.moe
    m, c, e, layers = config.batch, config.context, config.embed, moe.num_moe_layers
    count = sum(math.prod(shape) for shape in model_shapes(config).values())
    # Per token: the window (int64, twice), its embeddings and their gradient (float32).
    window = c * (16 + 8 * e)
    # Per token and layer: a dozen [d] vectors, a few [n] score rows, the k slots' expert activations.
    activations = layers * 4 * (12 * moe.hidden_size + 6 * moe.num_experts
                                + 3 * moe.top_k * (3 * moe.intermediate_size + 2 * moe.latent_size)) + 4 * 4 * VOCAB
    return [
        ("context", f"the context windows of the batches ((--batch {m} + {config.eval_batch} held out) x --context "
                    f"{c}, with --embed {e})", (m + config.eval_batch) * window),
        ("batch", f"a batch's activations (--batch {m} tokens through {layers} layers)", m * activations),
        ("moe.num_experts", f"the model's {count:,} parameters, their gradients and Adam's moments", 20 * count),
    ]


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def check_resources(config: TrainConfig, corpus: Corpus | None = None) -> None:
    """Raise `TrainConfigError` naming the field if the run cannot be trained here, before anything is allocated.

    The held-out text must be longer than the context, and the run's arrays
    (estimated from the sizes) must fit in this machine's memory.
    """
    parts = _memory_parts(config)
    total = sum(size for _, _, size in parts)
    memory = _physical_memory()
    if memory is not None and total > memory:
        name, what, size = max(parts, key=lambda part: part[2])
        raise TrainConfigError(name, f"the run would need about {_gib(total)} of memory, more than this machine's "
                                     f"{_gib(memory)}; the largest part is {what}: {_gib(size)}")
    if corpus is not None and config.context >= corpus.data.size - corpus.split:
        raise TrainConfigError("context", f"context must be shorter than the held-out text "
                                          f"({corpus.data.size - corpus.split:,} bytes), got {config.context:,}")


def _gib(size: float) -> str:
    return f"{size / 2**40:,.2f} TiB" if size >= 2**40 else f"{size / 2**30:,.2f} GiB"


# ---------------------------------------------------------------------------
# The state of a run, and its checkpoint
# ---------------------------------------------------------------------------

#: What `latest.json` says a checkpoint folder is, and the layout's version.
CHECKPOINT_FORMAT = "refimpl.train checkpoint"
CHECKPOINT_VERSION = 1
_POINTER = "latest.json"
#: The names a checkpoint folder holds: the pointer, the checkpoints, the ones being written.
_CHECKPOINT_NAME = re.compile(r"step-\d{8}-[0-9a-f]{8}")
_PARTIAL_NAME = re.compile(r"\.step-\d{8}-.+\.partial")
_POINTER_PARTIAL = re.compile(r"\.latest\.json\..+\.partial")


@dataclass
class _Run:
    """The complete state of a run between two steps: what a checkpoint holds.

    `step` steps are done; `rng` draws the next batch (its state is the data
    position); `records` is the log so far, `sessions` the stretches of steps
    each process trained (`first_step`, `last_step`, `seconds`).
    """

    step: int
    params: dict[str, np.ndarray]
    adam: Adam
    balancers: list[Balancer]
    rng: np.random.Generator
    records: list[dict[str, Any]] = field(default_factory=list)
    overflow_steps: int = 0
    skipped: int = 0
    sessions: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def start(cls, config: TrainConfig, ranks: Ranks = ONE_PROCESS) -> _Run:
        """Step 0: the weights drawn with `config.seed` (this process's part of them), fresh balancers and optimizer."""
        rng = np.random.default_rng(config.seed)
        params = ranks.shard(init_model(config, rng))
        trained = [name for name in params if not name.endswith(BIAS)]
        adam = Adam(trained, params, config.lr, config.betas, config.eps)
        return cls(0, params, adam, _balancers(config), rng)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint on disk, as `read_checkpoint` finds it: its folder, the steps done and the configuration."""

    folder: Path
    step: int
    config: TrainConfig
    manifest: dict[str, Any]


def _json_safe(value: Any, nonfinite: Callable[[float], Any]) -> Any:
    """`value` with every non-finite float replaced by `nonfinite(x)` and NumPy scalars made plain."""
    if isinstance(value, Mapping):
        return {key: _json_safe(item, nonfinite) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item, nonfinite) for item in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else nonfinite(float(value))
    return value


#: How `log.json` of a checkpoint writes a number that is not finite, so that it reads back exactly.
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _nonfinite_name(x: float) -> str:
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def _numbers_back(value: Any) -> Any:
    """The inverse of writing non-finite numbers as `_NONFINITE`'s strings (a step record holds no other string)."""
    if isinstance(value, dict):
        return {key: _numbers_back(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_numbers_back(item) for item in value]
    return _NONFINITE.get(value, value) if isinstance(value, str) else value


def _npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _write_file(path: Path, data: bytes) -> None:
    """Write a new file of a checkpoint being staged, flushed to the disk."""
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _digest(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _write_checkpoint(folder: str | Path, run: _Run, config: TrainConfig, corpus: Corpus) -> Path:
    """Write the state of `run` as a new checkpoint in `folder` and make it the current one; returns its folder.

    The files go into a new folder under a temporary name, each flushed to
    the disk; the folder is renamed to its final name, then `latest.json` is
    replaced atomically to name it, and only then are the earlier
    checkpoints of the folder removed. A process killed at any moment
    leaves `latest.json` naming a complete checkpoint.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"step-{run.step:08d}"
    staging = Path(tempfile.mkdtemp(prefix=f".{stem}-", suffix=".partial", dir=folder))
    try:
        os.chmod(staging, new_folder_mode())
        _write_file(staging / "params.npz", _npz_bytes(run.params))
        _write_file(staging / "adam.npz", _npz_bytes({**{f"m.{name}": value for name, value in run.adam.m.items()},
                                                       **{f"v.{name}": value for name, value in run.adam.v.items()}}))
        for number, balancer in enumerate(run.balancers):
            balancer.save(staging / f"balancer-{number}.npz")
        log = {"steps": run.records, "sessions": run.sessions}
        _write_file(staging / "log.json", json.dumps(_json_safe(log, _nonfinite_name), allow_nan=False).encode())
        manifest = {
            "format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "step": run.step,
            "config": config.to_record(), "corpus_sha256": corpus.sha256,
            "rng": run.rng.bit_generator.state, "adam_step": run.adam.t,
            "overflow_steps": run.overflow_steps, "skipped_steps": run.skipped,
            "files": {path.name: _digest(path) for path in sorted(staging.iterdir())},
        }
        _write_file(staging / "manifest.json", json.dumps(manifest, indent=1, allow_nan=False).encode())
        fsync_folder(staging)
        final = folder / f"{stem}-{secrets.token_hex(4)}"
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_folder(folder)
    pointer = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "checkpoint": final.name,
               "step": run.step}
    write_atomically(folder / _POINTER, lambda handle: handle.write(json.dumps(pointer, indent=1).encode()))
    # The new checkpoint is current: the earlier ones, and any left half-written by a killed run, go.
    for entry in folder.iterdir():
        if entry.name == final.name:
            continue
        if entry.is_dir() and (_CHECKPOINT_NAME.fullmatch(entry.name) or _PARTIAL_NAME.fullmatch(entry.name)):
            shutil.rmtree(entry)
        elif entry.is_file() and _POINTER_PARTIAL.fullmatch(entry.name):
            entry.unlink()
    return final


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{what}: {path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what}: {path} cannot be read as JSON: {exc}") from None


def read_checkpoint(folder: str | Path) -> Checkpoint:
    """The current checkpoint of `folder` (the one `latest.json` names): its configuration and steps done.

    Raises `ValueError` naming the file when the folder holds no complete
    checkpoint, or one written by another format.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder holding a training checkpoint")
    if not (folder / _POINTER).is_file():
        raise ValueError(f"{folder} holds no complete training checkpoint (no {_POINTER}: a run that wrote "
                         "none yet, or another folder)")
    pointer = _read_json(folder / _POINTER, "the checkpoint pointer")
    if not isinstance(pointer, dict) or pointer.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{folder / _POINTER} is not a {CHECKPOINT_FORMAT!r} pointer")
    if pointer.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{folder / _POINTER} is version {pointer.get('version')!r} of the checkpoint format; "
                         f"this code reads version {CHECKPOINT_VERSION}")
    name = pointer.get("checkpoint")
    if not isinstance(name, str) or not _CHECKPOINT_NAME.fullmatch(name):
        raise ValueError(f"{folder / _POINTER} names no checkpoint folder of this format, got {name!r}")
    manifest = _read_json(folder / name / "manifest.json", "the checkpoint manifest")
    try:
        config = TrainConfig.from_record(manifest["config"])
        step = int(manifest["step"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{folder / name / 'manifest.json'} holds no readable configuration and step: {exc}") \
            from None
    return Checkpoint(folder / name, step, config, manifest)


def _differences(saved: Any, wanted: Any, where: str = "") -> list[str]:
    """The fields whose values differ between two configuration records, as `name: saved -> wanted`."""
    if isinstance(saved, dict) and isinstance(wanted, dict):
        return [line for key in sorted(set(saved) | set(wanted))
                for line in _differences(saved.get(key), wanted.get(key), f"{where}{key}.")]
    return [] if saved == wanted else [f"{where[:-1]}={saved!r} in the checkpoint, {wanted!r} here"]


def _load_run(folder: str | Path, config: TrainConfig, corpus: Corpus) -> _Run:
    """The run saved in `folder`, checked against `config` and `corpus` and against every file's digest."""
    found = read_checkpoint(folder)
    where, manifest = found.folder, found.manifest
    saved, wanted = found.config.to_record(), config.to_record()
    saved.pop("steps")
    wanted.pop("steps")
    different = _differences(saved, wanted)
    if different:
        raise ValueError(f"the checkpoint in {folder} was written by a different configuration: "
                         + "; ".join(different))
    if manifest.get("corpus_sha256") != corpus.sha256:
        raise ValueError(f"the checkpoint in {folder} was trained on another corpus (sha256 "
                         f"{str(manifest.get('corpus_sha256'))[:16]}, this one {corpus.sha256[:16]})")
    if found.step > config.steps:
        raise ValueError(f"the checkpoint in {folder} has done {found.step} steps, more than steps={config.steps}")
    for name, expected in manifest.get("files", {}).items():
        path = where / name
        if not path.is_file() or _digest(path) != expected:
            raise ValueError(f"{path} is not the file the checkpoint wrote (missing, or its size or SHA-256 "
                             "differs): the checkpoint is damaged")
    expected_files = {"params.npz", "adam.npz", "log.json",
                      *(f"balancer-{number}.npz" for number in range(config.moe.num_moe_layers))}
    if not expected_files <= set(manifest.get("files", {})):
        raise ValueError(f"{where / 'manifest.json'} lists the files {sorted(manifest.get('files', {}))}, not "
                         f"{sorted(expected_files)}")
    run = _Run.start(config)  # the structure to fill (the weights drawn here are all replaced)
    with np.load(where / "params.npz", allow_pickle=False) as data:
        params = {name: data[name] for name in data.files}
    shapes = model_shapes(config)
    if set(params) != set(shapes) or any(params[name].shape != shapes[name] or params[name].dtype != np.float32
                                         for name in shapes):
        raise ValueError(f"{where / 'params.npz'} does not hold the parameters of this model")
    run.params = params
    with np.load(where / "adam.npz", allow_pickle=False) as data:
        for name in run.adam.names:
            run.adam.m[name], run.adam.v[name] = data[f"m.{name}"], data[f"v.{name}"]
    run.adam.t = int(manifest["adam_step"])
    for number, fresh in enumerate(run.balancers):
        restored = Balancer.restore(where / f"balancer-{number}.npz")
        if (type(restored), restored.options(), restored.num_experts, restored.top_k) != \
                (type(fresh), fresh.options(), fresh.num_experts, fresh.top_k):
            raise ValueError(f"{where / f'balancer-{number}.npz'} holds a {restored.kind} balancer with "
                             f"{restored.options()}, not the {fresh.kind} balancer {fresh.options()} of this run")
        run.balancers[number] = restored
    run.rng.bit_generator.state = manifest["rng"]
    log = _numbers_back(_read_json(where / "log.json", "the checkpoint log"))
    run.records, run.sessions = log["steps"], log["sessions"]
    if [record["step"] for record in run.records] != list(range(1, found.step + 1)):
        raise ValueError(f"{where / 'log.json'} does not hold the records of steps 1 to {found.step}")
    run.step = found.step
    run.overflow_steps, run.skipped = int(manifest["overflow_steps"]), int(manifest["skipped_steps"])
    # The run that wrote it may have stopped at its own last step, which it evaluated; this one evaluates
    # only on its schedule.
    for record in run.records:
        if record["step"] % config.eval_every and record["step"] != config.steps:
            record.pop("eval_loss", None)
    return run


# ---------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------

def _clip(grads: dict[str, np.ndarray], max_norm: float, ranks: Ranks = ONE_PROCESS) -> float:
    """Scale all gradients so their global norm is at most `max_norm` (0: no clipping); returns the norm before."""
    total = math.sqrt(ranks.sum_of_squares(grads))
    if max_norm > 0 and total > max_norm:
        for name in grads:
            grads[name] = (grads[name] * (max_norm / total)).astype(np.float32)
    return total


def train(config: TrainConfig, *, corpus: Corpus | None = None, progress: bool = False,
          log: Callable[[str], None] | None = None, final_params: dict[str, np.ndarray] | None = None,
          checkpoint: str | Path | None = None, checkpoint_every: int = 0,
          resume: str | Path | None = None, ranks: Ranks = ONE_PROCESS) -> dict[str, Any]:
    """Train the model of `config` and return the log `{"config", "corpus", "steps", "summary"}`.

    `steps` holds one record per step: `step` (from 1), `loss`,
    `max_violation` (largest over layers), `max_violation_layers` and
    `grad_norm` (global, before clipping; absent on a skipped step); on every
    `stats_every`-th step (and step 1; every step in a low-precision run) the per-layer
    `activation_peak`, `routed_rms`, `grad_norm_down` and `grad_norm_up`; on every `eval_every`-th step
    (and the last) `eval_loss`; `overflow: true` where the largest routed activation lies
    beyond the precision's range, and `skipped: true` where the update was
    skipped (an overflow, or a loss or gradient that is not finite); with an
    auxiliary loss `aux_loss` (per layer) and `objective`; with a capacity
    `drop_rate` (per layer). A run
    whose weights grow until its forward pass overflows has diverged: it goes
    on to the end with every step skipped and its loss NaN, and its held-out
    loss is NaN. `summary` has the
    wall time, the throughput in tokens per second and `sessions` (the steps
    and seconds of each process that trained the run). If `final_params` is
    a dict, it receives the trained weights.

    `checkpoint` is a folder to write the complete state into every
    `checkpoint_every` steps (0: only at the end) and at the end; `resume`
    a checkpoint folder to continue from, written by the same configuration
    (its `steps` may differ). A resumed run's log equals that of the run
    never interrupted, every number but the timings.

    `ranks` is where the steps run (`forward_backward`): one process by
    default; `refimpl.train_parallel.train_expert_parallel` passes its
    ranks, and each step's record then adds what `ranks.step_record()`
    gives. Checkpoints are written and resumed by one process only.
    """
    corpus = load_corpus() if corpus is None else corpus
    check_resources(config, corpus)
    if type(ranks) is not Ranks and (checkpoint is not None or resume is not None):
        raise ValueError(f"checkpoint= and resume= are for a run on one process; this one runs on "
                         f"{type(ranks).__name__} ({ranks.size} ranks)")
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, numbers.Integral) \
            or checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be a non-negative integer (0: only at the end), "
                         f"got {checkpoint_every!r}")
    run = _Run.start(config, ranks) if resume is None else _load_run(resume, config, corpus)
    train_data = corpus.data[:corpus.split]
    eval_rng = np.random.default_rng([config.seed, 1])
    eval_tokens, eval_targets = sample_batch(corpus.data[corpus.split:], eval_rng, config.eval_batch, config.context)
    # Every process draws the whole batch from the same generator and keeps its rows.
    mine = ranks.rows(config.eval_batch)
    eval_tokens, eval_targets = eval_tokens[mine], eval_targets[mine]
    mine = ranks.rows(config.batch)
    peak_limit = float(ml_dtypes.finfo(PRECISIONS[config.precision]).max)
    eval_layers = [balancer.layer_config(config.moe) for balancer in run.balancers]
    steps: Iterable[int] = range(run.step + 1, config.steps + 1)
    if progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc=f"train {config.balancer}", unit="step", file=sys.stderr, leave=False,
                     initial=run.step, total=config.steps)
    session = {"first_step": run.step + 1, "last_step": run.step, "seconds": 0.0}
    if run.step < config.steps:
        run.sessions.append(session)
    start = time.perf_counter()
    for t in steps:
        tokens, targets = sample_batch(train_data, run.rng, config.batch, config.context)
        tokens, targets = tokens[mine], targets[mine]
        # A low-precision run needs the peak every step: it decides whether the step overflowed.
        with_stats = t % config.stats_every == 0 or t == 1 or config.precision != "float32"
        result = forward_backward(run.params, tokens, targets, run.balancers, config, with_stats=with_stats,
                                  ranks=ranks)
        record: dict[str, Any] = {"step": t, "loss": result.loss, "max_violation": max(result.violations),
                                  "max_violation_layers": result.violations, **result.balancing}
        overflow = bool(result.stats.get("activation_peak")) and max(result.stats["activation_peak"]) > peak_limit
        run.overflow_steps += overflow
        finite = bool(result.grads) and ranks.all(all(np.all(np.isfinite(g))
                                                         for g in result.grads.values()))
        if overflow:
            record["overflow"] = True
        if finite and not overflow:
            record["grad_norm"] = _clip(result.grads, config.grad_clip, ranks)
            run.adam.step(run.params, result.grads)
        else:
            record["skipped"] = True
            run.skipped += 1
        if with_stats:
            record.update(result.stats)
        if t % config.eval_every == 0 or t == config.steps:
            record["eval_loss"] = evaluate(run.params, eval_tokens, eval_targets, config, eval_layers,
                                           ranks=ranks)
        record.update(ranks.step_record())
        run.records.append(record)
        run.step = session["last_step"] = t
        session["seconds"] = time.perf_counter() - start
        if checkpoint is not None and ((checkpoint_every and t % checkpoint_every == 0) or t == config.steps):
            _write_checkpoint(checkpoint, run, config, corpus)
        if progress:
            steps.set_postfix(loss=f"{result.loss:.3f}", viol=f"{record['max_violation']:.2f}")
    session["seconds"] = time.perf_counter() - start
    if "eval_loss" not in run.records[-1]:  # resumed at its last step from a checkpoint between evaluations
        run.records[-1]["eval_loss"] = evaluate(run.params, eval_tokens, eval_targets, config, eval_layers,
                                                ranks=ranks)
    if final_params is not None:
        final_params.update(run.params)
    seconds = sum(part["seconds"] for part in run.sessions)
    records = run.records
    summary = {"seconds": seconds, "tokens_per_second": config.batch * config.steps / seconds if seconds else 0.0,
               "skipped_steps": run.skipped, "activation_overflow_steps": run.overflow_steps,
               "final_eval_loss": records[-1]["eval_loss"], "sessions": run.sessions}
    if log is not None:
        log(f"{config.steps} steps of {config.batch} tokens in {seconds:.1f} s: "
            f"{summary['tokens_per_second']:,.0f} tokens/s; final loss {records[-1]['loss']:.4f}, "
            f"held-out loss {summary['final_eval_loss']:.4f}, last max violation {records[-1]['max_violation']:.3f}")
    return {"config": config.to_record(), "corpus": corpus.record(), "steps": records, "summary": summary}


def _train_quietly(config: TrainConfig) -> dict[str, Any]:
    return train(config)


def train_many(configs: Sequence[TrainConfig], processes: int = 2) -> list[dict[str, Any]]:
    """Train several configurations, `processes` at a time (one process each), and return their logs in order.

    The experiments' long runs use it; each run is as deterministic as a
    single `train` call, whatever the order the processes finish in.
    """
    configs = list(configs)
    if processes <= 1 or len(configs) <= 1:
        return [train(config) for config in configs]
    from multiprocessing import get_context

    with get_context("fork").Pool(processes) as pool:
        return pool.map(_train_quietly, configs, chunksize=1)


def noise_floor(m: int, n: int, top_k: int, *, draws: int = 200, seed: int = 0) -> np.ndarray:
    r"""The max violation of perfectly fair random routing: `draws` samples, `[draws]`.

    Each of $m$ tokens picks $k$ distinct experts uniformly at random (the
    top-$k$ of i.i.d. uniform scores), so every expert's expected load is
    exactly $q = mk/n$; what remains is sampling noise. No bias computed from
    a past batch can do better on a fresh batch of independent tokens.
    """
    rng = np.random.default_rng(seed)
    q = m * top_k / n
    floor = np.empty(draws)
    for draw in range(draws):
        index, _ = route(rng.random((m, n), dtype=np.float32), np.zeros(n, np.float32), top_k)  # [m, k]
        load = np.bincount(index.reshape(-1), minlength=n)  # [n]
        floor[draw] = load.max() / q - 1.0
    return floor


# ---------------------------------------------------------------------------
# The log file
# ---------------------------------------------------------------------------

def write_log(path: str | Path, log: Mapping[str, Any]) -> None:
    """Write a training log to `path` as strict JSON (a non-finite number becomes `null`), atomically.

    The text goes to a temporary file in the same folder, is flushed to the
    disk and renamed over `path`: a write that fails leaves the previous
    file as it was.
    """
    text = json.dumps(_json_safe(log, lambda x: None), indent=1, allow_nan=False) + "\n"
    write_atomically(path, lambda handle: handle.write(text.encode()))


# ---------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------

def _integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in `[low, high]`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"between {low:,} and {high:,}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value:,}")
        return value
    parse.__name__ = "integer"
    return parse


def _number(*, zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number, positive (or also 0 with `zero=True`)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"must be a {'non-negative' if zero else 'positive'} finite number, "
                                             f"got {text}")
        return value
    parse.__name__ = "number"
    return parse


#: The flags of the layer's sizes: flag, the `MoEConfig` field, help, the largest value a CPU run can mean.
_LAYER_FLAGS = (
    ("d", "hidden_size", "model width", 65536),
    ("latent", "latent_size", "latent width l", 65536),
    ("experts", "num_experts", "routed experts n", 65536),
    ("top-k", "top_k", "experts per token k", 65536),
    ("intermediate", "intermediate_size", "expert intermediate size f", 65536),
    ("shared", "num_shared_experts", "shared experts", 1024),
    ("layers", "num_moe_layers", "MoE blocks L", 1024),
)
#: The flags of the model around the layers and of the run: flag, the `TrainConfig` field, help, the largest value.
_RUN_FLAGS = (
    ("context", "context", "bytes of context", None),
    ("embed", "embed", "byte embedding width", 65536),
    ("batch", "batch", "tokens per step m", None),
    ("stats-every", "stats_every", "log activation and gradient statistics every this many steps", None),
    ("eval-every", "eval_every", "held-out loss every this many steps", None),
)


class _Refused(Exception):
    """An argument error of one rank, held until the ranks have shared their errors."""


class _SharedErrorsParser(argparse.ArgumentParser):
    """A parser whose errors are raised (`_Refused`) instead of ending the process, so that the ranks share them."""

    def error(self, message: str) -> NoReturn:
        raise _Refused(message)


def _parser(*, defaults: bool = True, shared_errors: bool = False) -> argparse.ArgumentParser:
    """The command's parser; with `defaults=False` the flags not given are absent from the result."""
    train_defaults, layer_defaults = TrainConfig(), DEFAULT_LAYER

    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    kind = _SharedErrorsParser if shared_errors else argparse.ArgumentParser
    parser = kind(prog="python -m refimpl.train", allow_abbrev=False,
                                     description="Train a small byte-level Stable LatentMoE language model and "
                                                 "log loss and load balance per step as JSON.")
    parser.add_argument("--balancer", choices=sorted(BALANCERS), default=default(train_defaults.balancer),
                        help="how each layer's selection bias follows the router (default qb)")
    parser.add_argument("--steps", type=_integer(1), default=default(train_defaults.steps),
                        help="training steps (default 300); with --resume, the step to continue to")
    parser.add_argument("--seed", type=_integer(0, 2**63 - 1), default=default(train_defaults.seed),
                        help="seed of weights and batches (default 0)")
    parser.add_argument("--out", type=Path, default=default(None), metavar="FILE",
                        help="write the JSON log to this file")
    parser.add_argument("--overwrite", action="store_true", default=default(False),
                        help="replace an existing --out file, or a --checkpoint folder holding another run's "
                             "checkpoint (each only once the new one is complete)")
    parser.add_argument("--checkpoint", type=Path, default=default(None), metavar="DIR",
                        help="write the complete training state into this folder at the end (and every "
                             "--checkpoint-every steps)")
    parser.add_argument("--checkpoint-every", type=_integer(0), default=default(0), metavar="N",
                        help="also checkpoint every N steps (default 0: only at the end)")
    parser.add_argument("--resume", type=Path, default=default(None), metavar="DIR",
                        help="continue the run checkpointed in DIR to --steps (checkpointing into DIR unless "
                             "--checkpoint names another folder)")
    parser.add_argument("--activation", choices=["situ", "swiglu"], default=default(layer_defaults.activation),
                        help="expert activation: situ (SiTU-GLU, K3) or swiglu")
    parser.add_argument("--latent-norm", choices=["on", "off"], default=default("on"),
                        help="RMSNorm on the routed latent sum: on (Stable LatentMoE) or off (LatentMoE)")
    parser.add_argument("--precision", choices=list(PRECISIONS), default=default(train_defaults.precision),
                        help="format the forward pass is rounded to (default float32)")
    parser.add_argument("--lr", type=_number(), default=default(train_defaults.lr),
                        help="Adam learning rate (default 0.003)")
    parser.add_argument("--grad-clip", type=_number(zero=True), default=default(train_defaults.grad_clip),
                        help="clip the global gradient norm to this (0: off, the default)")
    parser.add_argument("--gamma", "--sign-rate", dest="sign_rate", type=_number(), metavar="GAMMA",
                        default=default(train_defaults.sign_rate),
                        help="the sign rule's step (default 0.001, DeepSeek-V3's)")
    parser.add_argument("--bins", type=_integer(1, 10**7), default=default(train_defaults.bins),
                        help="histogram bins for qb-hist")
    parser.add_argument("--micro-batches", dest="micro_batches", type=_integer(1),
                        default=default(train_defaults.micro_batches), help="micro-batches per step for qb-hist")
    sizes = parser.add_argument_group("sizes")
    for flag, name, text, high in _LAYER_FLAGS:
        sizes.add_argument(f"--{flag}", dest=name, type=_integer(0 if name == "num_shared_experts" else 1, high),
                           default=default(getattr(layer_defaults, name)), metavar=flag.upper().replace("-", "_"),
                           help=f"{text} (default {getattr(layer_defaults, name)})")
    for flag, name, text, high in _RUN_FLAGS:
        sizes.add_argument(f"--{flag}", dest=name, type=_integer(1, high), default=default(getattr(train_defaults, name)),
                           help=f"{text} (default {getattr(train_defaults, name)})")
    parser.add_argument("--expert-parallel", action="store_true", default=default(False),
                        help="train over the ranks of an MPI job, each holding n/P experts of every layer and its "
                             "slice of every batch: mpiexec -n P python -m refimpl.train --expert-parallel ...")
    parser.add_argument("--quiet", action="store_true", default=default(False), help="no progress bar and no summary")
    return parser


#: The flag of each configuration field that has one (the layer's fields without their `moe.`).
_FLAG_OF = {"balancer": "--balancer", "steps": "--steps", "seed": "--seed", "precision": "--precision",
            "lr": "--lr", "grad_clip": "--grad-clip", "sign_rate": "--gamma", "bins": "--bins",
            "micro_batches": "--micro-batches", "activation": "--activation", "use_latent_norm": "--latent-norm",
            "latent_norm": "--latent-norm", **{name: f"--{flag}" for flag, name, _, _ in _LAYER_FLAGS + _RUN_FLAGS}}


def _flag(name: str) -> str | None:
    """The flag that sets the configuration field `name` (`"batch"`, `"moe.top_k"`), or None."""
    return _FLAG_OF.get(name.removeprefix("moe."))


def _layer_from_args(args: argparse.Namespace) -> MoEConfig:
    return DEFAULT_LAYER.replace(activation=args.activation, use_latent_norm=args.latent_norm == "on",
                                 **{name: getattr(args, name) for _, name, _, _ in _LAYER_FLAGS})


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The `TrainConfig` of parsed command-line arguments."""
    names = {f.name for f in fields(TrainConfig)} - {"moe"}
    return TrainConfig(moe=_layer_from_args(args), **{name: getattr(args, name) for name in names
                                                      if hasattr(args, name)})


def _config_or_error(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TrainConfig:
    """The configuration of the flags, or an argparse error naming the flag that is wrong."""
    # The two rules between the layer's flags, said in the flags' words.
    if args.latent_size > args.hidden_size:
        parser.error(f"argument --latent: must be at most --d ({args.hidden_size}), got {args.latent_size}")
    if args.top_k >= args.num_experts:
        parser.error(f"argument --top-k: must be smaller than --experts ({args.num_experts}) for balancing to "
                     f"mean anything, got {args.top_k}")
    try:
        return config_from_args(args)
    except TrainConfigError as exc:
        _config_error(parser, exc)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    raise AssertionError("unreachable")


def _config_error(parser: argparse.ArgumentParser, exc: TrainConfigError) -> None:
    flag = _flag(exc.field)
    parser.error(f"argument {flag}: {exc}" if flag else str(exc))


def _resumed_config(parser: argparse.ArgumentParser, found: Checkpoint, given: Mapping[str, Any],
                    steps: int) -> TrainConfig:
    """The checkpoint's configuration continued to `steps`; any other flag given must agree with it."""
    saved = found.config
    record = {**{name: getattr(saved, name) for name in given if hasattr(saved, name) and name != "moe"},
              **{name: getattr(saved.moe, name) for name in given if name in MoEConfig.__dataclass_fields__}}
    record.pop("steps", None)
    if "latent_norm" in given:
        record["latent_norm"] = "on" if saved.moe.use_latent_norm else "off"
    for name, value in record.items():
        if given[name] != value:
            flag = _flag(name) or name
            parser.error(f"argument {flag}: the checkpoint in {found.folder.parent} was trained with {flag} "
                         f"{value}, and a resumed run cannot change it (got {given[name]})")
    if steps < found.step:
        parser.error(f"argument --steps: the checkpoint in {found.folder.parent} has done {found.step} steps; "
                     f"--steps must be at least that, got {steps}")
    return replace(saved, steps=steps)


def _existing_ancestor(path: Path) -> Path:
    """The nearest folder above `path` (or `path` itself) that exists."""
    for folder in (path, *path.parents):
        if folder.exists():
            return folder
    return Path.cwd()


def _check_folder_writable(parser: argparse.ArgumentParser, flag: str, folder: Path) -> None:
    """`folder` must be a folder this process can write in, or one it can create; else an argparse error.

    Nothing is created: a file is written and removed in the folder, or in the
    nearest folder above it that exists (the missing ones are made when the
    run writes).
    """
    above = _existing_ancestor(folder)
    if not above.is_dir():
        parser.error(f"argument {flag}: {above} is a file, not a folder, so {folder} cannot be created")
    try:
        with tempfile.NamedTemporaryFile(dir=above, prefix=".write-test-"):
            pass
    except OSError as exc:
        parser.error(f"argument {flag}: cannot write in the folder {above}: {exc.strerror or exc}")


def _check_out(parser: argparse.ArgumentParser, out: Path, overwrite: bool) -> None:
    """`--out` must name a file that can be written, and replace an existing one only with `--overwrite`."""
    if out.is_dir():
        parser.error(f"argument --out: {out} is a folder; name the log file to write, e.g. {out / 'run.json'}")
    _check_folder_writable(parser, "--out", out.parent)
    if out.exists() and not overwrite:
        parser.error(f"argument --out: {out} already exists; pass --overwrite to replace it (it is replaced only "
                     "once the new log is written in full)")


def _check_checkpoint_folder(parser: argparse.ArgumentParser, folder: Path, *, resume: Path | None,
                             overwrite: bool) -> None:
    """`--checkpoint` must be a new or empty folder, or one of checkpoints this run may replace."""
    if folder.exists() and not folder.is_dir():
        parser.error(f"argument --checkpoint: {folder} is a file, not a folder")
    if folder.is_dir():
        names = sorted(entry.name for entry in folder.iterdir())
        resuming_here = resume is not None and folder.resolve() == resume.resolve()
        if _POINTER in names:
            # A checkpoint folder: only its own names are ever written or removed, the user's files stay.
            if not (resuming_here or overwrite):
                parser.error(f"argument --checkpoint: {folder} already holds a training checkpoint; pass --resume "
                             f"{folder} to continue it, or --overwrite to replace it once this run writes its "
                             "first checkpoint")
        else:
            others = [name for name in names if not (_CHECKPOINT_NAME.fullmatch(name) or _PARTIAL_NAME.fullmatch(name)
                                                     or _POINTER_PARTIAL.fullmatch(name))]
            if others:
                parser.error(f"argument --checkpoint: {folder} holds files that are not a training checkpoint "
                             f"({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}); name a new or empty "
                             "folder")
    _check_folder_writable(parser, "--checkpoint", folder)


def _checked_config(parser: argparse.ArgumentParser, args: argparse.Namespace,
                    argv: list[str]) -> TrainConfig:
    """The run's configuration from the flags (or the checkpoint being resumed), checked, or an argparse error."""
    if args.resume is not None:
        try:
            found = read_checkpoint(args.resume)
        except ValueError as exc:
            parser.error(f"argument --resume: {exc}")
        config = _resumed_config(parser, found, vars(_parser(defaults=False).parse_args(argv)), args.steps)
    else:
        config = _config_or_error(parser, args)
    try:
        check_resources(config)
    except TrainConfigError as exc:
        _config_error(parser, exc)
    return config


def _checked_corpus(parser: argparse.ArgumentParser, config: TrainConfig) -> Corpus:
    corpus = load_corpus()
    try:
        check_resources(config, corpus)
    except TrainConfigError as exc:
        _config_error(parser, exc)
    return corpus


def _write_out(parser: argparse.ArgumentParser, out: Path, result: Mapping[str, Any], checkpoint: Path | None,
               say: Callable[[str], None]) -> None:
    """Write the log to `--out`, or end with status 1 naming the file (which is left as it was)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_log(out, result)
    except OSError as exc:
        kept = f"; the log so far is in the checkpoint {checkpoint}" if checkpoint is not None else ""
        parser.exit(1, f"{parser.prog}: error: could not write the log to {out}: {exc}; the file "
                       f"there (if any) is unchanged{kept}\n")
    say(f"log written to {out}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The command `python -m refimpl.train`: check every argument, train, print what was read and the throughput, write the log."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--expert-parallel" in argv:
        return _main_expert_parallel(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    config = _checked_config(parser, args, argv)
    checkpoint = args.checkpoint if args.checkpoint is not None else args.resume
    if args.checkpoint_every and checkpoint is None:
        parser.error("argument --checkpoint-every: needs --checkpoint DIR (the folder to write into)")
    if args.out is not None:
        _check_out(parser, args.out, args.overwrite)
    if checkpoint is not None:
        _check_checkpoint_folder(parser, checkpoint, resume=args.resume, overwrite=args.overwrite)
    corpus = _checked_corpus(parser, config)
    say = (lambda text: None) if args.quiet else print
    say(corpus.describe())
    result = train(config, corpus=corpus, progress=not args.quiet and config.steps >= 50, log=say,
                   checkpoint=checkpoint, checkpoint_every=args.checkpoint_every, resume=args.resume)
    result["command"] = "python -m refimpl.train " + " ".join(argv)
    if args.out is not None:
        _write_out(parser, args.out, result, checkpoint, say)
    return result


def _main_expert_parallel(argv: list[str]) -> dict[str, Any]:
    """The command with `--expert-parallel`, on every rank of the job: the ranks share their argument errors.

    Each rank checks the arguments as the one-process command does (rank 0
    alone checks `--out`, the file it writes), without stopping at an error;
    then the ranks agree on the configuration and share their errors
    (`refimpl.train_parallel.check_expert_parallel`), so that every rank ends
    with the same message and status 2 instead of some waiting for the
    others. A rank that fails while training ends the whole job (`Abort`).
    """
    try:
        from .train_parallel import check_expert_parallel, train_expert_parallel, world

        comm = world()
    except ImportError as exc:
        _parser().error(f"argument --expert-parallel: needs mpi4py and an MPI library ({exc}); install them with "
                        "pip install mpi4py mpich, and start the job with mpiexec -n P")
    rank, size = int(comm.Get_rank()), int(comm.Get_size())
    parser = _parser(shared_errors=True)
    config, corpus, args, error = None, None, None, None
    try:
        args = parser.parse_args(argv)
        for flag, value in (("--checkpoint", args.checkpoint), ("--resume", args.resume),
                            ("--checkpoint-every", args.checkpoint_every)):
            if value:
                parser.error(f"argument {flag}: not available with --expert-parallel (checkpoints are written and "
                             "resumed by a run on one process)")
        config = _checked_config(parser, args, argv)
        if args.out is not None and rank == 0:
            _check_out(parser, args.out, args.overwrite)
        corpus = _checked_corpus(parser, config)
    except _Refused as exc:
        error = ValueError(str(exc))
    try:
        check_expert_parallel(config, comm, corpus=corpus, error=error)
    except (TypeError, ValueError) as exc:
        _parser().error(str(exc))  # every rank: the same message, status 2
    say = print if rank == 0 and not args.quiet else (lambda text: None)
    say(corpus.describe())
    per_rank = config.moe.num_experts // size
    say(f"expert parallel: {size} rank{'s' if size > 1 else ''}, {per_rank} experts of each layer per rank, "
        f"{config.batch // size}-{-(-config.batch // size)} rows of each batch of {config.batch}")
    try:
        result = train_expert_parallel(config, comm, corpus=corpus, progress=not args.quiet and config.steps >= 50,
                                       log=say)
    except Exception:
        if size == 1:
            raise
        # The other ranks may be waiting in an exchange for this one: end the whole job, saying why.
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
        raise
    result["command"] = f"mpiexec -n {size} python -m refimpl.train " + " ".join(argv)
    say(_rank_table(result["expert_parallel"]))
    if args.out is not None and rank == 0:
        _write_out(parser, args.out, result, None, say)
    return result


def _rank_table(summary: Mapping[str, Any]) -> str:
    """Each rank's slots computed and seconds per stage over the run, as printed at the end of an expert-parallel run."""
    stages = list(summary["rank_seconds"])
    widths = [max(len(stage), 8) for stage in stages]
    lines = ["seconds per stage, summed over the run's layers and steps:",
             f"{'rank':>4} {'experts':>9} {'rows':>6} {'slots':>10}"
             + "".join(f"  {stage:>{width}}" for stage, width in zip(stages, widths, strict=True))]
    for rank in range(summary["ranks"]):
        first, stop = summary["experts"][rank]
        times = summary["rank_seconds"]
        lines.append(f"{rank:>4} {f'{first}-{stop - 1}':>9} {summary['batch_rows'][rank]:>6} "
                     f"{summary['rank_load'][rank]:>10,}"
                     + "".join(f"  {times[stage][rank]:>{width}.3f}" for stage, width in zip(stages, widths, strict=True)))
    lines.append(f"most loaded rank over the mean, per layer and step: {summary['mean_max_over_mean_load']:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    # `python -m refimpl.train` runs this file as `__main__`; the command runs in the package's own module,
    # whose classes (TrainConfig, Ranks) are those the other modules of the package import.
    from refimpl.train import main as _main

    _main()
