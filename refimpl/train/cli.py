r"""The command `python -m refimpl.train`: every argument checked before anything is allocated.

Run it as `python -m refimpl.train --balancer qb --steps 300 --seed 0 --out run.json`;
`python -m refimpl.train --help` lists the sizes and switches. Before it
allocates anything or trains a step it checks:

* every number (a negative seed, a size of 0, a `--batch` too small for
  the balancer, a NaN learning rate, a context longer than the held-out
  text, a model, batch or `qb-hist` histogram (`--bins`) that would not fit
  in this machine's memory): an error naming the flag, exit status 2;
* `--out`: not a folder, not under a regular file, in a folder it can
  write; an existing file is refused unless `--overwrite` is given;
* `--checkpoint`: a new or empty folder, or one holding a checkpoint (of
  this run when resuming, or any with `--overwrite`); neither it inside
  `--out` nor `--out` inside it;
* every path: one the operating system refuses to look at (a name too
  long, a folder this process may not enter) is an error naming the flag;
* `--resume`: a readable checkpoint, and no flag that contradicts it;
* with `--expert-parallel`: every rank checks its own arguments (rank 0
  alone checks `--out`, the file it writes), and the ranks then share their
  errors (any exception met while checking, not only an argument error)
  and compare their configurations, seed and corpus, so that every
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
import math
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, NoReturn

from ..config import MoEConfig
from .checkpoints import Checkpoint, check_checkpoint_folder, read_checkpoint
from .config import BALANCERS, DEFAULT_LAYER, PRECISIONS, TrainConfig, TrainConfigError
from .data import Corpus, load_corpus
from .expert_parallel import check_expert_parallel, train_expert_parallel, world
from .loop import check_resources, train, write_log

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


def _unreadable_path(parser: argparse.ArgumentParser, flag: str, path: Path, exc: OSError) -> NoReturn:
    """End with the argparse error (status 2) for a path the operating system refuses to look at.

    A name longer than the system allows (`ENAMETOOLONG`), a folder above it this process may not enter
    (`EACCES`), a loop of symbolic links: `stat` itself fails, and the run is refused naming the flag, with
    the system's reason, instead of a traceback.
    """
    named = str(path) if len(str(path)) <= 80 else f"{str(path)[:60]}... ({len(str(path))} characters)"
    parser.error(f"argument {flag}: {named} cannot be checked: {exc.strerror or exc}")


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
    try:
        above = _existing_ancestor(folder)
        is_folder = above.is_dir()
    except OSError as exc:
        _unreadable_path(parser, flag, folder, exc)
    if not is_folder:
        parser.error(f"argument {flag}: {above} is a file, not a folder, so {folder} cannot be created")
    try:
        with tempfile.NamedTemporaryFile(dir=above, prefix=".write-test-"):
            pass
    except OSError as exc:
        parser.error(f"argument {flag}: cannot write in the folder {above}: {exc.strerror or exc}")


def _check_out(parser: argparse.ArgumentParser, out: Path, overwrite: bool) -> None:
    """`--out` must name a file that can be written, and replace an existing one only with `--overwrite`."""
    try:
        is_folder = out.is_dir()
    except OSError as exc:
        _unreadable_path(parser, "--out", out, exc)
    if is_folder:
        parser.error(f"argument --out: {out} is a folder; name the log file to write, e.g. {out / 'run.json'}")
    _check_folder_writable(parser, "--out", out.parent)
    try:
        exists = out.exists()
    except OSError as exc:
        _unreadable_path(parser, "--out", out, exc)
    if exists and not overwrite:
        parser.error(f"argument --out: {out} already exists; pass --overwrite to replace it (it is replaced only "
                     "once the new log is written in full)")


def _check_checkpoint_folder(parser: argparse.ArgumentParser, folder: Path, *, resume: Path | None,
                             overwrite: bool) -> None:
    """`--checkpoint` must be a new or empty folder, or one of checkpoints this run may replace."""
    try:
        check_checkpoint_folder(folder, resume=resume, overwrite=overwrite)
    except ValueError as exc:
        parser.error(f"argument --checkpoint: {str(exc).removeprefix('checkpoint: ')}")
    _check_folder_writable(parser, "--checkpoint", folder)


def _check_out_outside(parser: argparse.ArgumentParser, out: Path, checkpoint: Path) -> None:
    """`--out` and the checkpoint folder must not lie one inside the other, checked before the first step.

    The log inside the checkpoint folder would be a file no checkpoint owns; the checkpoint folder inside
    `--out` (`--out x.json --checkpoint x.json/ck`) makes the log's name a folder, so the whole run would
    train and then fail to write its log. Both paths are resolved (`.`, `..` and symbolic links).
    """
    try:
        out_path, folder = out.resolve(), checkpoint.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a loop of symbolic links (Python before 3.13)
        parser.error(f"argument --checkpoint: {checkpoint} or --out {out} cannot be resolved: "
                     f"{getattr(exc, 'strerror', None) or exc}")
    if out_path.is_relative_to(folder):
        parser.error(f"argument --out: {out} lies inside the checkpoint folder {checkpoint}; write the log "
                     "elsewhere (a checkpoint folder holds only the checkpoint's own files)")
    if folder.is_relative_to(out_path):
        parser.error(f"argument --checkpoint: {checkpoint} lies inside --out {out}, the log file the run writes "
                     "at its end; name a checkpoint folder outside it")


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
        if args.out is not None:
            _check_out_outside(parser, args.out, checkpoint)
    corpus = _checked_corpus(parser, config)
    say = (lambda text: None) if args.quiet else print
    say(corpus.describe())
    try:
        result = train(config, corpus=corpus, progress=not args.quiet and config.steps >= 50, log=say,
                       checkpoint=checkpoint, checkpoint_every=args.checkpoint_every, resume=args.resume,
                       overwrite=args.overwrite)
    except ValueError as exc:  # refused while running: a folder another run holds, a checkpoint edited meanwhile
        _refused(parser, exc)
    result["command"] = "python -m refimpl.train " + " ".join(argv)
    if args.out is not None:
        _write_out(parser, args.out, result, checkpoint, say)
    return result


def _refused(parser: argparse.ArgumentParser, exc: ValueError) -> NoReturn:
    """End the command with one line on stderr and status 1: an input refused once the run had started.

    Every refusal is a `ValueError` that names the file or folder and what was expected; the traceback
    under it would only show where in this package the check runs.
    """
    message = " ".join(str(exc).split())  # one line, whatever the message holds
    parser.exit(1, f"{parser.prog}: error: {message}\n")


def _main_expert_parallel(argv: list[str]) -> dict[str, Any]:
    """The command with `--expert-parallel`, on every rank of the job: the ranks share their argument errors.

    Each rank checks the arguments as the one-process command does (rank 0
    alone checks `--out`, the file it writes), without stopping at an error;
    then the ranks agree on the configuration and share their errors
    (`refimpl.train.expert_parallel.check_expert_parallel`), so that every rank ends
    with the same message and status 2 instead of some waiting for the
    others. A rank that fails while training ends the whole job (`Abort`).
    """
    try:
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
    except Exception as exc:  # noqa: BLE001 - any failure here must reach the other ranks, not leave them waiting
        error = exc
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
