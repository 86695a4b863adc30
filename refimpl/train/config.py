r"""The configuration of a training run, and the table of balancing rules it chooses from.

`TrainConfig` holds every number a run depends on: the layer of every block
as one `MoEConfig` (`moe`), the model around the layers, the batch, the
optimizer, the balancer and how often to log. It is validated on
construction, so a run that cannot be trained is refused before anything is
allocated, with the field named (`TrainConfigError.field`).

`BALANCERS` maps each `--balancer` name to the rule that builds one
`refimpl.balancing.Balancer` per block; the name is the kind the balancer is
saved under, so a rule has one name from the command line to the checkpoint
(the two capacities share the kind `capacity` and differ in its factor).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, NoReturn

import ml_dtypes
import numpy as np

from ..balancing import Balancer, FrozenBalancer, QuantileBalancer, SignBalancer
from ..balancing.histogram import HistogramBalancer
from ..balancing.other_balancers import AuxLossBalancer, CapacityBalancer, HashBalancer, SequenceLossBalancer
from ..config import MoEConfig

#: Floating formats the forward pass can be rounded to.
PRECISIONS: dict[str, Any] = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
}

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
        if self.moe.activation == "relu2":  # the ungated expert is a GLU whose gate and up weights stay one matrix
            fail("moe.activation", "must be 'situ' or 'swiglu': training updates each expert's gate and up "
                                   "matrices apart, so a 'relu2' layer's tied weights would come apart, got 'relu2'")
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
    # The other balancers (refimpl.balancing.other_balancers): auxiliary losses, capacity with dropping, hash routing.
    "aux": lambda config: AuxLossBalancer(config.moe.num_experts, config.moe.top_k),
    "seq": lambda config: SequenceLossBalancer(config.moe.num_experts, config.moe.top_k, rate=config.sign_rate),
    "capacity-1.0": lambda config: CapacityBalancer(config.moe.num_experts, config.moe.top_k, capacity_factor=1.0),
    "capacity-1.25": lambda config: CapacityBalancer(config.moe.num_experts, config.moe.top_k,
                                                     capacity_factor=1.25),
    "hash": lambda config: HashBalancer(config.moe.num_experts, config.moe.top_k),
}


def new_balancers(config: TrainConfig) -> list[Balancer]:
    """One fresh balancer per block."""
    return [BALANCERS[config.balancer](config) for _ in range(config.moe.num_moe_layers)]
