r"""Expert parallelism over MPI: four ranks, two all-to-alls, and the slowest rank

`refimpl.ep_forward` run the way a deployment runs it: `mpiexec -n 4`, each
rank holding a quarter of the experts and its own tokens (uneven shards, one
rank with none). Started plainly (`python examples/81_expert_parallel_mpi.py`),
the script relaunches itself under the `mpiexec` that the MPICH wheel put next
to the Python interpreter; every rank reports to rank 0, which prints.

1. **The same layer.** The four ranks' outputs, gathered, against
   `stable_latent_moe` of the union of their tokens in one process.
2. **What travels.** Each rank's (token, rank) pairs and the bytes of both
   all-to-alls, against a full-width MoE that shares the router (the ratio
   is $\ell/d$), and against $k\ell$ per token, the bound when every expert
   of a token sits on a different rank.
3. **The pitfall.** The same run with each rank normalizing its partial sum
   before sending it back, and the error that causes.
4. **The balancer across ranks.** One integer `Allreduce` of the
   $n \times B$ histogram, and the same bias on every rank bit for bit.
5. **Balance is speed.** Zero bias, the sign rule and Quantile Balancing
   (both trained across the ranks on a stream of batches) on a skewed router;
   for each, the time of one `ep_forward` step against the load of the
   slowest rank. With four ranks on a two-core machine the ranks take turns
   on the cores: see the page "Balance is speed" for what that measurement
   can and cannot show.
"""

# %%
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from refimpl import (
    MoEConfig,
    ep_balance_update,
    ep_forward,
    expected_remote_ranks,
    expert_load,
    histogram_balancing_update,
    init_params,
    route,
    router_scores,
    shard_params,
    sign_balancing_update,
    stable_latent_moe,
)
from refimpl.studies.figures import in_notebook, show_figure
from refimpl.studies.workloads import skewed_batch, skewed_router

# %%

#: This script, which relaunches itself under mpiexec (in a notebook there is no script: see `rank_program`).
SCRIPT = Path(__file__).resolve() if "__file__" in globals() else None

#: The figure rank 0 draws, with what it shows.
FIGURE = "ep_step_time.png"
CAPTION = ("The median time of one ep_forward step against the slowest rank's share of the tokens, for the "
           "zero bias, the sign rule and Quantile Balancing; the dotted line is a step time in proportion to "
           "the slowest rank.")
ALT = ("Scatter of the median step time in milliseconds against the slowest rank's load over the mean load, "
       "one point per bias, with a dotted line through Quantile Balancing's point and the origin")


def rank_program(folder: Path) -> Path:
    """The file every rank runs: this script, or, in a notebook, the cells run so far, saved into `folder`.

    A notebook has no file of its own; the code of the cells it has run (every definition above) followed by
    a call of `main` is the same program as the script.
    """
    if SCRIPT is not None:
        return SCRIPT
    from IPython import get_ipython

    cells = get_ipython().user_ns["In"][1:-1]  # the cells run before the one that calls main
    path = folder / "81_expert_parallel_mpi.py"
    path.write_text("\n\n".join(cells) + '\n\n\nif __name__ == "__main__":\n    main()\n', encoding="utf-8")
    return path


def under_mpi() -> bool:
    """True when an MPI launcher started this process (MPICH/Hydra and Open MPI set these)."""
    return any(name in os.environ for name in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE"))


def relaunch(program: Path, argv: list[str], ranks: int, timeout: float) -> int:
    """Run `program` under `mpiexec -n ranks` (the one next to this Python), print what it printed."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.is_file():
        raise SystemExit(f"no mpiexec next to {sys.executable}: pip install mpi4py mpich")
    command = [str(mpiexec), "-n", str(ranks), sys.executable, "-m", "mpi4py", str(program), *argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    # One BLAS thread per rank, as MPI jobs run: the ranks, not the threads, share the cores.
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(name, "1")
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and every rank
        stdout, stderr = process.communicate()
        print(stdout)
        raise SystemExit(f"mpiexec -n {ranks} did not finish in {timeout:.0f} s:\n{stderr}") from None
    print(stdout, end="")
    if process.returncode:
        print(stderr, file=sys.stderr)
    return process.returncode


# %% [markdown]
# ## The layer and the tokens

# %%


def layer(args: argparse.Namespace, plain: bool = False) -> tuple[MoEConfig, dict[str, np.ndarray]]:
    """The whole layer (every rank builds the same one) in float64; `plain`: a full-width MoE, same router."""
    config = MoEConfig(hidden_size=args.width, latent_size=args.width // 2, num_experts=args.experts,
                       top_k=args.top_k, intermediate_size=args.intermediate, num_shared_experts=1)
    params = dict(init_params(config, args.seed, dtype=np.float64))
    weight, _ = skewed_router(args.experts, args.width, args.seed)
    params["gate.weight"] = weight.astype(np.float64)
    if not plain:
        return config, params
    full = config.replace(latent_size=args.width, use_latent_projection=False, use_latent_norm=False)
    other = dict(init_params(full, args.seed + 1, dtype=np.float64))
    other["gate.weight"] = params["gate.weight"]
    return full, other


def uneven_tokens(args: argparse.Namespace, size: int) -> list[np.ndarray]:
    """Every rank's own tokens: shard r holds (r + 1) * 64 tokens, except rank 2, which holds none."""
    counts = [0 if r == 2 else 64 * (r + 1) for r in range(size)]
    _, mean = skewed_router(args.experts, args.width, args.seed)
    x = skewed_batch(np.zeros((1, args.width)), mean, sum(counts), args.seed, 999_999).astype(np.float64)
    return np.split(x, np.cumsum(counts)[:-1])


# %% [markdown]
# ## 1-4: the same layer, what travels, the pitfall, the balancer

# %%


def correctness(args: argparse.Namespace, comm) -> bool:
    rank, size = comm.Get_rank(), comm.Get_size()
    config, params = layer(args)
    x = uneven_tokens(args, size)[rank]
    mine = shard_params(params, config, rank, size)
    y, stats = ep_forward(x, mine, config, comm)
    y_wrong, _ = ep_forward(x, mine, config, comm, reduce_before_norm=False)
    plain_config, plain_params = layer(args, plain=True)
    _, plain_stats = ep_forward(x, shard_params(plain_params, plain_config, rank, size), plain_config, comm)
    scores = router_scores(x, params["gate.weight"])
    bias = ep_balance_update(scores, params["gate.e_score_correction_bias"], config.k, comm, bins=args.bins)
    report = comm.gather((y, y_wrong, stats, plain_stats, scores, bias), root=0)
    if rank != 0:
        return True
    ys, wrongs, stats_, plains, score_blocks, biases = zip(*report, strict=True)
    union = np.concatenate(uneven_tokens(args, size))
    single = stable_latent_moe(union, params, config, return_intermediates=True)
    got = np.concatenate(ys)
    error = float(np.abs(got - single.y).max() / np.abs(single.y).max())
    print(f"{size} ranks under mpiexec; n = {config.n} experts, {config.n // size} per rank, k = {config.k}, "
          f"d = {config.d}, l = {config.ell}, float64")
    print(f"tokens per rank: {[len(part) for part in ys]}")
    print()
    print(f"1. gathered ep_forward vs stable_latent_moe on the union: max |diff| / max |y| = {error:.1e}")
    print()
    print("2. what each rank sent to the others (its own share is a local copy):")
    print(f"{'rank':>4} {'pairs to ranks 0..P-1':>24} {'dispatch B':>11} {'combine B':>10} {'routing B':>10} "
          f"{'full-width B':>13} {'ratio':>6}")
    for r, (s, p) in enumerate(zip(stats_, plains, strict=True)):
        ratio = f"{s.dispatch_bytes / p.dispatch_bytes:.3f}" if p.dispatch_bytes else "-"
        print(f"{r:>4} {str(s.pairs_sent.tolist()):>24} {s.dispatch_bytes:>11,} {s.combine_bytes:>10,} "
              f"{s.routing_bytes:>10,} {p.dispatch_bytes:>13,} {ratio:>6}")
    dispatch = sum(s.dispatch_bytes for s in stats_)
    plain = sum(p.dispatch_bytes for p in plains)
    bound = len(union) * config.k * config.ell * 8
    remote = dispatch // (config.ell * 8)
    if plain:
        print(f"total dispatch {dispatch:,} B = {dispatch / plain:.3f} of the full-width MoE's {plain:,} B "
              f"(l/d = {config.ell / config.d:.3f})")
    print(f"sent once per (token, rank): {remote:,} latents for {len(union):,} tokens x k = "
          f"{len(union) * config.k:,} slots; the k*l-per-token bound would be {bound:,} B")
    print(f"uniform routing would send {expected_remote_ranks(config.n, config.k, size):.2f} latents per token; "
          f"this skewed router sent {remote / len(union):.2f}")
    print()
    planning_table(MoEConfig.k3())
    print()
    wrong = np.concatenate(wrongs)
    per_rank = config.n // size
    spans = np.array([len(set((row // per_rank).tolist())) > 1 for row in single.index])
    relative = np.abs(wrong - got).max(axis=1) / np.abs(got).max()
    print("3. the pitfall: each rank normalizes its partial sum before the combine")
    print(f"   tokens whose experts span several ranks: {spans.sum()} of {len(spans)}", end="")
    print(f"; their max relative error {relative[spans].max():.2f}, median {np.median(relative[spans]):.2f}"
          if spans.any() else "")
    if (~spans).any():
        print(f"   tokens whose experts sit on one rank: {(~spans).sum()}; max relative error "
              f"{relative[~spans].max():.1e} (one partial sum is the whole sum)")
    print()
    same = all(b.tobytes() == biases[0].tobytes() for b in biases)
    # One process histograms the same scores (the ranks' blocks, stacked): counts add, so the bias is the
    # same to the bit. Scores recomputed from the stacked tokens would not do: a product's rounding depends
    # on how many rows BLAS multiplies at once, and a score one unit in the last place away can fall into
    # the next bin.
    union_scores = np.concatenate(score_blocks)  # [m, n]
    reference = histogram_balancing_update([union_scores], params["gate.e_score_correction_bias"], config.k,
                                           args.bins)
    print("4. the balancer: one Allreduce of n x B = "
          f"{config.n} x {args.bins} int64 counts = {config.n * args.bins * 8:,} B")
    print(f"   the same bits on every rank: {'yes' if same else 'NO'}; "
          "equal to one process on the union of the ranks' scores: "
          f"{'yes' if reference.tobytes() == biases[0].tobytes() else 'NO'}")
    print()
    return error < 1e-12 and same and reference.tobytes() == biases[0].tobytes()


def planning_table(config: MoEConfig) -> None:
    """Expected bytes per token for K3 at several expert-parallel degrees, uniform routing, bfloat16."""
    print(f"   K3 (n = {config.n}, k = {config.k}, l = {config.ell}, d = {config.d}), uniform routing, 2-byte "
          "values: expected bytes per token, each way")
    print(f"   {'P':>5} {'experts/rank':>12} {'other ranks':>11} {'latent layer':>12} {'full width':>10} "
          f"{'k*l bound':>9}")
    for size in (8, 16, 32, 64, 128, 896):
        remote = expected_remote_ranks(config.n, config.k, size)
        print(f"   {size:>5} {config.n // size:>12} {remote:>11.2f} {remote * config.ell * 2:>12,.0f} "
              f"{remote * config.d * 2:>10,.0f} {config.k * config.ell * 2:>9,}")


# %% [markdown]
# ## 5: balance is speed

# %%


def trained_biases(args: argparse.Namespace, comm, config: MoEConfig) -> dict[str, np.ndarray]:
    """Zero bias, and the biases the sign rule and Quantile Balancing reach across the ranks."""
    rank = comm.Get_rank()
    weight, mean = skewed_router(config.n, config.d, args.seed)
    from mpi4py import MPI

    sign = np.zeros(config.n, np.float32)
    quantile = np.zeros(config.n, np.float32)
    for step in range(args.steps):
        scores = router_scores(skewed_batch(weight, mean, args.train_tokens, args.seed, 1000 * step + rank), weight)
        # Quantile Balancing: the histogram of every rank's tokens, one integer Allreduce.
        quantile = ep_balance_update(scores, quantile, config.k, comm, bins=args.bins)
        # The sign rule: the global load, one integer Allreduce of n counts.
        load = np.asarray(expert_load(route(scores, sign, config.k)[0], config.n), dtype=np.int64)
        comm.Allreduce(MPI.IN_PLACE, load, op=MPI.SUM)
        sign = sign_balancing_update(load, sign, args.rate)
    return {"zero bias": np.zeros(config.n, np.float32), "sign rule": sign, "Quantile Balancing": quantile}


def speed(args: argparse.Namespace, comm, out: Path | None, save: Path | None = None) -> list[dict]:
    rank, size = comm.Get_rank(), comm.Get_size()
    config, params = layer(args)
    params = {name: a.astype(np.float32) for name, a in params.items()}
    weight, mean = skewed_router(config.n, config.d, args.seed)
    x = skewed_batch(weight, mean, args.tokens, args.seed, 10**6 + rank)  # a fresh batch, [m, d] float32
    rows = []
    for name, bias in trained_biases(args, comm, config).items():
        mine = shard_params(dict(params, **{"gate.e_score_correction_bias": bias}), config, rank, size)
        ep_forward(x, mine, config, comm)  # warm-up
        times, expert_times, expert_cpu = [], [], []
        for _ in range(args.repeats):
            comm.Barrier()
            start = time.perf_counter()
            _, stats = ep_forward(x, mine, config, comm)
            comm.Barrier()
            times.append(time.perf_counter() - start)
            expert_times.append(stats.expert_seconds)
            expert_cpu.append(stats.expert_cpu_seconds)
        report = comm.gather((stats.expert_load, statistics.median(expert_times), statistics.median(expert_cpu)),
                             root=0)
        if rank == 0:
            loads, expert_seconds, cpu_seconds = zip(*report, strict=True)
            per_expert = np.concatenate(loads)
            per_rank = np.array([load.sum() for load in loads])
            rows.append({"case": name, "expert_max_over_mean": float(per_expert.max() / per_expert.mean()),
                         "rank_max_over_mean": float(per_rank.max() / per_rank.mean()),
                         "rank_loads": per_rank.tolist(), "step_ms": 1e3 * statistics.median(times),
                         "best_ms": 1e3 * min(times),
                         "expert_ms": [round(1e3 * t, 1) for t in expert_seconds],
                         "expert_cpu_ms": [round(1e3 * t, 1) for t in cpu_seconds]})
    if rank == 0:
        print(f"5. balance is speed: {args.tokens:,} tokens per rank, n = {config.n}, k = {config.k}, "
              f"d = {config.d}, l = {config.ell}, f = {config.f}, float32; biases trained for {args.steps} "
              f"steps of {args.train_tokens} tokens per rank (sign rule step {args.rate})")
        print(f"{'bias':<20} {'expert max/mean':>15} {'rank max/mean':>13} {'step (median)':>13}  "
              "slots per rank; each rank's processor time in its experts (ms)")
        for row in rows:
            print(f"{row['case']:<20} {row['expert_max_over_mean']:>15.2f} {row['rank_max_over_mean']:>13.2f} "
                  f"{row['step_ms']:>10.1f} ms  {row['rank_loads']}; {row['expert_cpu_ms']}")
        base = rows[-1]
        print("step time relative to Quantile Balancing: "
              + ", ".join(f"{r['case']} {r['step_ms'] / base['step_ms']:.2f}x" for r in rows)
              + "; slowest rank's load relative: "
              + ", ".join(f"{r['rank_max_over_mean'] / base['rank_max_over_mean']:.2f}x" for r in rows)
              + "; slowest rank's processor time in its experts relative: "
              + ", ".join(f"{max(r['expert_cpu_ms']) / max(base['expert_cpu_ms']):.2f}x" for r in rows))
        print(f"{size} ranks on {os.cpu_count()} CPUs")
        if out is not None:
            plot(rows, size, out)
        if save is not None:
            settings = {key: value for key, value in vars(args).items() if key not in ("out", "save")}
            save.write_text(json.dumps({"ranks": size, "settings": settings, "rows": rows}, indent=1))
    return rows


def plot(rows: list[dict], size: int, out: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for row in rows:
        ax.plot(row["rank_max_over_mean"], row["step_ms"], "o", label=row["case"])
    # If the step took exactly as long as its slowest rank's share of the work:
    base = rows[-1]
    ratios = np.linspace(1.0, max(row["rank_max_over_mean"] for row in rows), 20)
    ax.plot(ratios, base["step_ms"] * ratios / base["rank_max_over_mean"], ":", color="gray",
            label="proportional to the slowest rank")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("slowest rank's load / mean rank load")
    ax.set_ylabel("ep_forward step (ms, median)")
    ax.set_title(f"{size} ranks under mpiexec")
    ax.legend()
    fig.tight_layout()
    show_figure(fig, out, FIGURE, caption=CAPTION, alt=ALT)


# %% [markdown]
# ## Main: relaunch under mpiexec, or run as one rank

# %%


def main(argv: list[str] | None = None) -> bool:
    parser = argparse.ArgumentParser(description="Expert parallelism over MPI: four ranks, two all-to-alls")
    parser.add_argument("--ranks", type=int, default=4, help="ranks to launch when started without mpiexec")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--width", type=int, default=256, help="d; the latent is d/2")
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank in the speed part")
    parser.add_argument("--train-tokens", type=int, default=512, help="tokens per rank per balancer step")
    parser.add_argument("--steps", type=int, default=20, help="balancer steps before the speed part")
    parser.add_argument("--rate", type=float, default=1e-3, help="the sign rule's step")
    parser.add_argument("--bins", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=81)
    parser.add_argument("--timeout", type=float, default=300, help="seconds the relaunched job may take")
    parser.add_argument("--out", type=Path, default=None, help="folder for the figure (rank 0 writes it)")
    parser.add_argument("--save", type=Path, default=None, help="rank 0 writes the speed table here (JSON)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not under_mpi():
        job_argv = sys.argv[1:] if argv is None else list(argv)
        with tempfile.TemporaryDirectory(prefix="refimpl-81-") as folder:
            # In a notebook rank 0 saves the figure here, and it is shown below the cell.
            show = in_notebook() and args.out is None
            code = relaunch(rank_program(Path(folder)), job_argv + (["--out", folder] if show else []),
                            args.ranks, args.timeout)
            if code:
                raise SystemExit(f"the MPI job failed (exit {code})")
            if show:
                show_figure((Path(folder) / FIGURE).read_bytes(), None, FIGURE, caption=CAPTION, alt=ALT)
        return True
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    ok = correctness(args, comm)
    speed(args, comm, args.out, args.save)
    ok = bool(comm.bcast(ok, root=0))
    if not ok:
        raise SystemExit("the ranks disagree with the single-process layer")
    return ok

    # What to see: in what `main` prints, part by part:
    #
    # 1. **The same layer.** The four ranks' outputs, gathered, equal the one-process layer to 4.4e-16, the
    #    rounding of float64: spreading experts and tokens over ranks changes where the arithmetic runs, not
    #    its result. Rank 2 holds no tokens yet sends 252,928 B in the combine, the outputs of its experts for
    #    the other ranks' tokens.
    # 2. **What travels.** Every rank's dispatch is 0.500 of the full-width MoE's, the ratio l/d, because the
    #    latent layer sends l = 128 values where the full-width one sends d = 256. A token goes once to each
    #    other rank that holds one of its experts, not once per expert: 970 latents for 1,792 slots, 2.17 per
    #    token against 2.11 for uniform routing. In the K3 table a token reaches more other ranks as P grows
    #    (15.98 other ranks for its k = 16 experts at P = 896), and its bytes approach the `k*l` bound of
    #    114,688.
    # 3. **The pitfall.** The RMSNorm of the routed sum is not linear: the norm of a sum is not the sum of the
    #    norms of its parts. Normalizing each rank's partial sum is therefore wrong for the 447 of 448 tokens
    #    whose experts span several ranks (relative error up to 0.73, median 0.37), and exact (0.0e+00) for
    #    the one token whose experts all sit on one rank: a run whose tokens all keep their experts on one
    #    rank cannot show the mistake.
    # 4. **The balancer.** Its only exchange is one integer Allreduce of 32 x 1000 counts, 256,000 B. Integer
    #    counts add exactly in any order, so every rank gets the same bias bit for bit, equal to the bias of
    #    one process holding all the scores.
    # 5. **Balance is speed.** A rank's load is the sum of its 8 experts' loads, so the expert imbalance
    #    (max/mean 3.63 with zero bias) shows only partly per rank: the slowest rank holds 1.42 times the
    #    mean, and 1.03 with Quantile Balancing (slots [4899, 5812, 2773, 2900] against [4060, 4220, 4027,
    #    4077]). Each rank's processor time in its experts follows its slots, and the step time follows the
    #    slowest rank, diluted by the router, the projections and the shared expert, which cost the same on
    #    every rank whatever the routing. The loads are exact; the times are rough when, as the last line
    #    shows, more ranks than CPUs share the machine.


# %%
if __name__ == "__main__":
    main()
