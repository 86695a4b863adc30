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
`refimpl.layer.backward.stable_latent_moe_vjp`: its forward pass gives the
output, the route and every intermediate, and its backward pass (derived by
hand on its own page) the gradients. The RMSNorms are
`refimpl.layer.activations.rms_norm` and its backward, the same as the layer's
latent norm. The rest is small and written out here: the embedding and
mixing, the output layer and the cross-entropy. The optimizer is Adam.
The step asks a `Ranks` object every question whose answer needs more than
one process's arrays (the layer, a balancer's step, the loss of the batch,
its gradients, "is it finite?"); on one process the answers are the plain
computations, and over MPI `refimpl.train.expert_parallel` gives the same answers
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

The last five are the rules K3 is compared with (`refimpl.balancing.other_balancers`).
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

## The package, file by file

| module | what it holds |
|---|---|
| `refimpl.train.data` | the corpus (standard-library sources, with their digests) and the batches drawn from it |
| `refimpl.train.config` | `TrainConfig`, the run's every number, and `BALANCERS`, the table of balancing rules |
| `refimpl.train.model` | the model around the layers: embedding, norms, output, cross-entropy, Adam |
| `refimpl.train.step` | one training step, forward and backward (`forward_backward`), and `Ranks`, the questions it asks of the processes it runs on |
| `refimpl.train.loop` | the run: steps, logging, evaluation, the resources a run needs |
| `refimpl.train.checkpoints` | the complete state of a run, written and read back bit for bit |
| `refimpl.train.expert_parallel` | the same step over the ranks of an MPI job |
| `refimpl.train.cli` | `python -m refimpl.train`: every argument checked before anything is allocated |

Data flows one way, from the data and the configuration to the model, the
step, the loop and its checkpoints; the command line and the MPI run sit on
top.

## Training over MPI

`mpiexec -n P python -m refimpl.train --expert-parallel ...` trains the
same model with $P$ ranks: each holds $n/P$ experts of every layer, the
other parameters whole, and its own slice of every batch (every rank draws
the whole batch from the same generator and keeps its rows). The layers run
through `refimpl.parallel.expert_parallel.ep_vjp`, the replicated parameters'
gradients are summed over the ranks, the balancers' statistics are those of
the whole batch (the exact quantiles for `qb`, the histogram counts for
`qb-hist`, the loads for the sign rule), and every rank holds the same bias
and the same replicated weights, bit for bit. The losses are those of the
one-process run with the same seed and batch, to float32 rounding. Rank 0
writes the log, which adds each rank's load and time per stage to every
step (`rank_load`, `rank_seconds`) and sums them in `expert_parallel`. The
page "Training over MPI: the experts and the batch split between the ranks
of a job" (`refimpl.train.expert_parallel`) says how each number is computed
across ranks, and what the ranks check before they exchange anything.
`--expert-parallel` started without `mpiexec` runs as one rank.
"""

from __future__ import annotations

from ..balancing import FrozenBalancer, HistogramBalancer
from .checkpoints import Checkpoint, read_checkpoint
from .cli import main
from .config import BALANCERS, DEFAULT_LAYER, PRECISIONS, TrainConfig, TrainConfigError, default_layer
from .data import CORPUS_FILES, VOCAB, Corpus, load_corpus, sample_batch
from .loop import check_resources, noise_floor, train, train_many, write_log
from .model import (
    BIAS,
    Adam,
    cross_entropy,
    init_model,
    model_shapes,
    rms_norm_vjp,
    routed_activation_peak,
    trained_params,
)
from .step import ONE_PROCESS, Ranks, StepResult, evaluate, forward_backward, single_process_layer

__all__ = [
    "BALANCERS", "BIAS", "CORPUS_FILES", "DEFAULT_LAYER", "ONE_PROCESS", "PRECISIONS", "VOCAB", "Adam", "Checkpoint", "FrozenBalancer", "HistogramBalancer",
    "Corpus", "Ranks", "StepResult", "TrainConfig", "TrainConfigError", "check_resources", "cross_entropy",
    "default_layer", "evaluate", "forward_backward", "init_model", "load_corpus", "main", "model_shapes",
    "noise_floor", "read_checkpoint", "rms_norm_vjp", "routed_activation_peak", "sample_batch",
    "single_process_layer", "train", "train_many", "trained_params", "write_log",
]
