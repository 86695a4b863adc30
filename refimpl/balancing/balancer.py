r"""The balancer: where a layer's bias lives between steps, and the one interface every balancing rule has.

A rule of Eq. (14)'s kind is not a function of one batch: the bias it
computes from batch $t$ routes batch $t+1$, so something must hold the bias
between the two. That is a `Balancer`. `step(scores)` routes a batch with the
bias it holds, records the loads, and only then computes the next bias from
that batch: a batch is never routed with a bias computed from itself.

Every rule of this package is a `Balancer` subclass that writes two methods,
`choose` (its route when it routes a batch alone; by default the biased
top-$k$ of Eq. 13) and `next_bias` (the bias for the next batch), and
declares what a training loop needs to know about it (the layer it
balances, whether it reads token ids, its auxiliary loss). The rules
themselves are on the pages of Eq. (14) (`QuantileBalancer`, `SignBalancer`,
`FrozenBalancer`), Appendix D (`HistogramBalancer`) and the other
balancers (auxiliary losses, capacity, hash routing).

`save` and `Balancer.restore` write and read the whole state of any rule,
bit for bit, so that a resumed training run routes exactly as one that was
never interrupted.
"""

from __future__ import annotations

import inspect
import json
import math
import zipfile
from dataclasses import dataclass
from os import PathLike
from typing import Any, ClassVar

import numpy as np

from .._lib.files import check_regular_file, parse_json, write_atomically
from .._lib.validation import check_float_array, check_int, check_shape
from .._lib.values import shown
from .._lib.xp import Array, array_namespace, is_array, to_numpy
from ..config import MoEConfig
from ..layer.routing import expert_load, route

__all__ = ["FORMER_KINDS", "BalanceStep", "Balancer", "load_ratio"]

#: Names that kinds were saved under before each kind took the one name it has in training (`--balancer`):
#: a file that says "quantile" is read as "qb". The former names stay reserved.
FORMER_KINDS = {"quantile": "qb", "histogram": "qb-hist"}


def load_ratio(load: Array) -> float:
    """The max/min load of a step (1.0 is perfect balance; infinity when some expert got no token).

    `load` `[n]` counts each expert's tokens: a non-empty 1-D array of non-negative integers (a ratio of no
    experts, or of fractional or negative counts, means nothing), else a `ValueError` naming `load`.
    """
    if not is_array(load):
        raise TypeError(f"load must be an array of token counts [n], got {type(load).__name__} {shown(load)}")
    values = to_numpy(load)
    if values.ndim != 1 or values.shape[0] < 1 or values.dtype.kind not in "iu":
        raise ValueError(f"load must be token counts [n] (a non-empty 1-D integer array, one count per expert), "
                         f"got {values.dtype} of shape {list(values.shape)}")
    low, high = int(values.min()), int(values.max())
    if low < 0:
        raise ValueError(f"load must hold non-negative token counts, got a smallest count of {low}")
    return math.inf if low == 0 else high / low


@dataclass(frozen=True)
class BalanceStep:
    """What one balancer step did.

    `index` `[m, k]` is the route of the batch, made with `bias` `[n]` (the
    bias held *before* the batch was seen); `load` `[n]` counts its tokens per
    expert and `ratio` is max/min of `load`; `next_bias` `[n]` is the bias
    computed from this batch, which will route the next one.
    """

    step: int
    index: Array
    load: np.ndarray
    ratio: float
    bias: np.ndarray
    next_bias: np.ndarray


class Balancer:
    r"""The one interface of every balancer: the place where a layer's bias lives between steps.

    A balancer holds the bias that will route the next batch. `step(scores)`
    routes the batch with that bias, records the loads, and only then
    computes the bias for the next batch from this one. In a training step
    the layer routes the batch itself (with the held bias) and hands its own
    route over, `step(scores, index=layer_route)`, so the loads recorded are
    those of the layer that ran. The bias is kept as a NumPy array in float32
    (or the `dtype` given), as K3 keeps it; each batch may come from any
    array namespace.

    What every balancer declares, so that a training loop needs to know
    nothing else about it:

    * `kind`, a class attribute: the name it is saved under (every subclass
      sets its own and is registered under it when the class is defined);
    * `layer_config(config)`: the layer it balances, the `MoEConfig` with the
      switches it changes (a capacity that drops, hash routing); most change
      nothing;
    * `needs_token_ids`: whether it routes by token id, so that `step` must
      be given `token_ids` when the layer's route is not;
    * `coefficient` and `auxiliary(scores, index)`: the weight of its
      auxiliary balance loss in the objective (0: it has none) and the loss
      with its gradient in the scores;
    * `options()`: its settings, the keywords that build it again;
    * the two rules a subclass writes: `choose(scores, bias, token_ids)`, its
      route when it routes a batch alone (default: the biased top-$k$ of
      Eq. 13), and `next_bias(scores, bias, index)`, the bias for the next
      batch.

    `save` writes the whole state (kind, options, bias, step count, history)
    to an `.npz` file atomically, and `Balancer.restore` reads it back bit for
    bit, whatever the kind, so a resumed run routes exactly as an
    uninterrupted one.

    History: `loads` (one `[n]` array per step), `ratios` (max/min per step)
    and `biases` (the bias that routed each step).

    The rules: `QuantileBalancer` (Eq. 14), `SignBalancer` (DeepSeek-V3),
    `FrozenBalancer` (no balancing), `refimpl.balancing.histogram.HistogramBalancer`
    (Appendix D) and, on the page "The other balancers in the training
    loop", auxiliary losses, capacity and hash routing.
    """

    kind: ClassVar[str] = ""
    needs_token_ids: ClassVar[bool] = False
    #: The weight of the auxiliary balance loss in the training objective (0: the balancer has none).
    coefficient: float = 0.0
    #: Every kind, by name: each subclass enters it under its `kind` when its class statement runs.
    kinds: ClassVar[dict[str, type[Balancer]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if not isinstance(kind, str) or not kind:
            raise TypeError(f"{cls.__name__} must set its own kind (the name it is saved under), as a class "
                            "attribute")
        known = Balancer.kinds.get(FORMER_KINDS.get(kind, kind))
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"the balancer kind {kind!r} is taken by {known.__module__}.{known.__qualname__}")
        Balancer.kinds[kind] = cls

    def __init__(self, num_experts: int, top_k: int, *, bias: Array | None = None,
                 dtype: Any = np.float32) -> None:
        self.num_experts = check_int("num_experts", num_experts, low=1)
        self.top_k = check_int("top_k", top_k, low=1, high=self.num_experts)
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype must be float32 or float64, got {dtype}")
        if bias is None:
            self._bias = np.zeros(self.num_experts, dtype=dtype)
        else:
            held = np.array(to_numpy(bias), dtype=dtype, copy=True)
            if held.shape != (self.num_experts,):
                raise ValueError(f"bias must have shape [{self.num_experts}], got {list(held.shape)}")
            if not np.isfinite(held).all():
                raise ValueError("bias must be finite")
            self._bias = held
        self.step_count = 0
        self.loads: list[np.ndarray] = []
        self.ratios: list[float] = []
        self.biases: list[np.ndarray] = []

    # -- what it declares ------------------------------------------------------

    @property
    def bias(self) -> np.ndarray:
        """A copy of the bias that will route the next batch."""
        return self._bias.copy()

    def options(self) -> dict[str, Any]:
        """The settings of this balancer: the keywords (besides sizes, bias and dtype) that build it again."""
        return {}

    def layer_config(self, config: MoEConfig) -> MoEConfig:
        """The layer this balancer balances: `config` with the switches it changes (here: none)."""
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        if (config.num_experts, config.top_k) != (self.num_experts, self.top_k):
            raise ValueError(f"the layer has num_experts={config.num_experts}, top_k={config.top_k}; this "
                             f"balancer was built for {self.num_experts} and {self.top_k}")
        return config

    def auxiliary(self, scores: Array, index: Array) -> tuple[float, np.ndarray]:
        """The auxiliary balance loss of a routed batch and its gradient in the scores `[m, n]` (none here: zeros)."""
        return 0.0, np.zeros(tuple(scores.shape))

    def check_batch(self, m: int) -> None:
        """Raise `ValueError` if this rule cannot balance batches of `m` tokens (a run checks before its first step)."""
        check_int("m", m, low=1)

    # -- the two rules a subclass writes --------------------------------------

    def choose(self, scores: Array, bias: Array, token_ids: Array | None) -> Array:
        """The route `[m, k]` of a batch this balancer routes alone: the top-$k$ of $s + b$ (Eq. 13)."""
        index, _ = route(scores, bias, self.top_k)
        return index

    def next_bias(self, scores: Array, bias: Array, index: Array) -> Array:
        """The bias `[n]` for the next batch, from this batch's `scores` `[m, n]`, the `bias` that routed it and its route."""
        raise NotImplementedError(f"{type(self).__name__} must define next_bias(scores, bias, index)")

    # -- the step --------------------------------------------------------------

    def step(self, scores: Array, *, index: Array | None = None, token_ids: Array | None = None) -> BalanceStep:
        """Route `scores` (`[m, n]`) with the held bias, then compute the next bias from them.

        `index` (`[m, k]`), if given, is the route the layer itself made of
        this batch with the held bias (a training step passes it, so that the
        loads are those of the layer that ran); otherwise the balancer routes
        the batch with `choose`, reading `token_ids` (`[m]`) when it
        `needs_token_ids`.
        """
        check_float_array("scores", scores, ndim=2)
        check_shape("scores", scores, (None, self.num_experts))
        xp = array_namespace(scores)
        used = self._bias.copy()  # fixed before the batch is looked at
        if index is None:
            if self.needs_token_ids and token_ids is None:
                raise ValueError(f"a {self.kind} balancer routes by token id: step() needs token_ids, an [m] "
                                 "integer array (or the layer's route as index=)")
            index = self.choose(scores, xp.asarray(used), token_ids)
        else:
            check_shape("index", index, (scores.shape[0], self.top_k))
        new_bias = self.next_bias(scores, xp.asarray(used), index)
        return self.advance(index, expert_load(index, self.num_experts), new_bias)

    def advance(self, index: Array, load: Array, next_bias: Array) -> BalanceStep:
        """The end of a step: record the batch's route `index` and `load` `[n]`, then hold `next_bias` `[n]`.

        `step` ends here. A step whose load and next bias are computed
        elsewhere calls it directly: an expert-parallel training step, where
        each rank routed only its own tokens (`index`) and the load and the
        next bias are those of the whole batch, gathered over the ranks.
        """
        load = to_numpy(load)
        if tuple(load.shape) != (self.num_experts,) or not np.issubdtype(load.dtype, np.integer) \
                or (load < 0).any():
            raise ValueError(f"load must be [{self.num_experts}] non-negative integer counts, got "
                             f"{load.dtype} of shape {list(load.shape)}")
        next_bias = to_numpy(next_bias)
        if tuple(next_bias.shape) != (self.num_experts,):
            raise ValueError(f"next_bias must have shape [{self.num_experts}], got {list(next_bias.shape)}")
        used = self._bias.copy()  # the bias that routed the batch
        load = load.astype(np.int64)
        ratio = load_ratio(load)
        self._bias = next_bias.astype(self._bias.dtype)
        self.step_count += 1
        self.loads.append(load)
        self.ratios.append(ratio)
        self.biases.append(used)
        return BalanceStep(self.step_count, index, load, ratio, used, self._bias.copy())

    # -- saving and restoring ----------------------------------------------------

    def save(self, path: str | PathLike) -> None:
        """Write the whole state to the `.npz` file `path`, atomically: kind, options, bias, step count, history.

        The file is written under a temporary name in the same folder and
        renamed into place, so `path` holds the old state or the new one,
        never a part. It needs no pickle: arrays, and the options as JSON.
        """
        n = self.num_experts
        arrays = {
            "kind": np.array(self.kind),
            "module": np.array(type(self).__module__),
            "options": np.array(json.dumps(self.options(), allow_nan=False)),
            "num_experts": np.int64(n),
            "top_k": np.int64(self.top_k),
            "step_count": np.int64(self.step_count),
            "bias": self._bias,
            "loads": np.array(self.loads, dtype=np.int64).reshape(-1, n),
            "ratios": np.array(self.ratios, dtype=np.float64),
            "biases": np.array(self.biases, dtype=self._bias.dtype).reshape(-1, n),
        }
        write_atomically(path, lambda handle: np.savez(handle, **arrays))

    @classmethod
    def restore(cls, path: str | PathLike) -> Balancer:
        """Read a balancer written by `save`, of any kind; the result continues the run bit for bit.

        Every kind of this package is defined once `refimpl.balancing` is
        imported (as `import refimpl` does); a kind of your own must be
        defined (its module imported) first. Nothing is imported by a name
        read from the file.
        """
        try:
            with np.load(check_regular_file(path, "the balancer state"), allow_pickle=False) as data:
                fields = {name: data[name] for name in data.files}
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            raise ValueError(f"{path} is not a balancer state written by Balancer.save: {exc}") from None
        if "kind" in fields and "options" not in fields:  # written before the options were kept as JSON
            fields["module"] = np.array("refimpl.balancing.quantile")
            fields["options"] = np.array(json.dumps({name: fields.pop(name).item() for name in
                                                     ("leave_one_out", "damping", "rate") if name in fields}))
        missing = sorted({"kind", "module", "options", "num_experts", "top_k", "step_count", "bias", "loads",
                          "ratios", "biases"} - set(fields))
        if missing:
            raise ValueError(f"{path} is not a balancer state written by Balancer.save: it lacks {missing}")
        kind, module = str(fields["kind"]), str(fields["module"])
        kind = FORMER_KINDS.get(kind, kind)  # a file written when the kind had its former name
        if kind not in Balancer.kinds:
            raise ValueError(f"{path} holds an unknown balancer kind {kind!r} (defined in {module!r}); known kinds: "
                             f"{sorted(Balancer.kinds)}")
        factory = Balancer.kinds[kind]
        options = _checked_options(parse_json(str(fields["options"]), f"{path}: the balancer's options"), factory,
                                   f"{path}: the field 'options' of a {kind!r} balancer")
        sizes = {}
        for name in ("num_experts", "top_k", "step_count"):
            if fields[name].shape != () or fields[name].dtype.kind not in "iu":
                raise ValueError(f"{path}: the field {name!r} must be one integer, got {fields[name].dtype} "
                                 f"of shape {list(fields[name].shape)}")
            sizes[name] = int(fields[name])
        try:
            balancer = factory(sizes["num_experts"], sizes["top_k"], bias=fields["bias"], dtype=fields["bias"].dtype,
                               **options)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: the fields 'options', 'num_experts', 'top_k' and 'bias' describe no "
                             f"{kind!r} balancer: {exc}") from None
        loads, ratios, biases = _checked_history(fields, balancer.num_experts, balancer._bias.dtype,
                                                 sizes["step_count"], path)
        balancer.step_count = sizes["step_count"]
        balancer.loads = list(loads)
        balancer.ratios = [float(r) for r in ratios]
        balancer.biases = list(biases)
        return balancer


def _checked_history(fields: dict[str, np.ndarray], n: int, dtype: np.dtype, step_count: int,
                     path: str | PathLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The history of a saved balancer (`loads`, `ratios`, `biases`), checked as `advance` would have written it.

    `advance` appends one entry to each per step and counts the step, so a file `save` wrote holds, for
    $s$ = `step_count` steps: `loads` `[s, n]` non-negative integer counts, `ratios` `[s]` floats (max/min
    of each load: at least 1, or infinity), `biases` `[s, n]` in the dtype of the bias. An edited file that
    breaks this is refused here, naming the file and the field, rather than restored into a balancer whose
    next `save` fails or whose history reads negative loads. Returns the three arrays (`loads` as int64).
    """
    loads, ratios, biases = fields["loads"], fields["ratios"], fields["biases"]

    def refuse(name: str, expected: str, array: np.ndarray) -> ValueError:
        return ValueError(f"{path}: the field {name!r} must be {expected}, got {array.dtype} of shape "
                          f"{list(array.shape)}")

    if loads.ndim != 2 or loads.shape[1] != n or loads.dtype.kind not in "iu":
        raise refuse("loads", f"integer counts [s, {n}] (one row of {n} experts per step)", loads)
    steps = loads.shape[0]
    if steps and (int(loads.min()) < 0 or int(loads.max()) > np.iinfo(np.int64).max):
        raise ValueError(f"{path}: the field 'loads' must hold token counts from 0 to 2**63 - 1, got values from "
                         f"{int(loads.min())} to {int(loads.max())}")
    if ratios.shape != (steps,) or ratios.dtype.kind != "f":
        raise refuse("ratios", f"floats [{steps}] (one max/min load ratio per step of 'loads')", ratios)
    if not (ratios >= 1.0).all():  # NaN fails too
        bad = ratios[~(ratios >= 1.0)]
        raise ValueError(f"{path}: the field 'ratios' must hold max/min load ratios (at least 1, or infinity), "
                         f"got {shown(bad[0].item())}")
    if biases.shape != (steps, n) or biases.dtype != dtype:
        raise refuse("biases", f"{dtype} [{steps}, {n}] (the bias that routed each step of 'loads', in the "
                               "dtype of the field 'bias')", biases)
    if step_count != steps:
        raise ValueError(f"{path}: the field 'step_count' must be the number of steps in the history ("
                         f"{steps}, the rows of 'loads', 'ratios' and 'biases'), got {step_count}")
    return loads.astype(np.int64), ratios, biases


def _checked_options(options: Any, factory: type, where: str) -> dict[str, Any]:
    """The options read from a saved balancer, as keywords `factory` takes; a `ValueError` naming `where` else.

    They must be a JSON object whose names are keywords of the balancer's constructor (besides the sizes,
    the bias and the dtype, which the file holds in fields of their own): an edited file that adds a name or
    replaces the object by a list is refused by name, not passed on to fail inside the constructor.
    """
    if not isinstance(options, dict):
        raise ValueError(f"{where} must be a JSON object of option names and values, got {shown(options)}")
    parameters = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return options
    accepted = sorted(name for name, p in parameters.items()
                      if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("bias", "dtype"))
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"{where} holds {unknown}, which are no options of it: expected some of {accepted}")
    return options
