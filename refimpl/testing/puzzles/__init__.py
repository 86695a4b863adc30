r"""Puzzles: learn the layer by writing it, with the kit trying to break each answer.

Reading a reference implementation teaches what it computes; writing it
yourself teaches why each line is the way it is. Each puzzle below hands you
one piece of the Stable LatentMoE layer of Kimi K3, in the order a reader
meets them from Eq. (13) to Appendix D, as a small task: its equation, the
arguments your function receives and what it returns. You write the function
with NumPy alone, and the puzzle's check tries to break it.

| | puzzle | the equation |
|---|---|---|
| 1 | sigmoid routing with a selection-only bias | Eq. (13): $\mathcal T_i = \operatorname{argtopk}_k(s_i + b)$ |
| 2 | the mixture weights and the top-1 rule | Eq. (13): $p_{i,j} = c\,s_{i,j} / \sum_{r \in \mathcal T_i} s_{i,r}$ |
| 3 | SiTU-GLU and its bound | Eq. (12): $[\operatorname{softcap}(a, \beta_1)\,\sigma(a)] \odot \operatorname{softcap}(b, \beta_2)$ |
| 4 | the latent forward | Eq. (11): the weighted sum in the latent, normalized once |
| 5 | the cutoffs | Eq. (14) step 1: the $(k{+}1)$-th biased score |
| 6 | the Quantile Balancing update, with ties | Eq. (14): $\tilde b_j = -$ the $(q{+}1)$-th largest margin |
| 7 | the dual coordinate step | Appendix C: the exact $\alpha$- and $\beta$-steps |
| 8 | the sign rule as SignSGD on the dual | $b_j \leftarrow b_j + \gamma \operatorname{sign}(q - \text{load}_j)$ |
| 9 | the histogram quantile within one bin | Appendix D |
| 10 | capacity with the drop priority of the textbook sketch | served rank by rank, then token by token |

## How a check tries to break an answer

`PUZZLES[name].check(fn)` calls your function on inputs that
[Hypothesis](https://hypothesis.readthedocs.io) draws (a few tokens, a few
experts) and compares every answer with what refimpl's own function returns
on the same input, so a puzzle teaches exactly what the library computes.
Each puzzle states where its expected answer comes from (`refimpl.route`,
`refimpl.quantile_balancing_update`, ...). When an answer differs,
Hypothesis **shrinks** the input to the simplest one that still breaks it,
and the check then asks which of the puzzle's **catalogued mistakes**
your answer makes: the mistakes real ports of the layer made and learners
write, such as the bias added into the mixture weights, a single top-1
weight renormalized to 1, an ascending sort, an unstable sort on ties, the
$q$-th instead of the $(q+1)$-th order statistic, float32 arithmetic, or
capacity served token by token instead of rank by rank. Each is a wrong
answer the check can run. A mistake is **named only when it is confirmed**:
it must give what your answer gives on the shrunk input, on inputs built to
tell the mistakes apart and on a few dozen drawn ones, and no other
catalogued mistake may do the same; one small input fits several mistakes
too often to name any from it alone. A mistake whose results depend on the
machine's NumPy (an unstable sort or `np.argpartition`, which leave equal
values in any order) is named from what the answer does instead: an
unstable sort only when the answer is right on every input without ties and
differs from the reference only where values tie, so an answer that is
wrong on an input without ties is never told it sorted unstably. A named mistake comes with why it is
wrong; otherwise the message says in plain words what differs (which token
got which experts, which entries are off and by how much). Every failure is
a `PuzzleFailure`, an `AssertionError` whose message opens with "Not yet:"
and holds the shrunk input as NumPy code you can paste, what was expected
and what came back.

Three more things fail an answer, each with a message that says so: a call
that does not return within 10 seconds (the check runs in a forked worker
process, which it stops; the inputs are tiny, so a right answer takes
milliseconds), an answer that writes into its arguments (the caller reads
them again), and a result NumPy cannot read as an array of the asked shape.

Three of the puzzles then hand a passing answer to the kit's own check for
that signature (`check_balancing_update`, `check_forward`,
`check_capacity`), which tries the invariants of the page "The conformance
kit" as well: the same tests a port of the layer would face.

The checks do not fail by luck. The draws are **derandomized** (the same
inputs on every run and every machine) and nothing is written into your
folder. The inputs are built so that float rounding cannot flip a selection:
scores and biases on a grid whose biased values are at least $2^{-14}$
apart, except in the properties that are about ties, where ties are exact
(values on a grid of eighths). Tolerances follow from the arithmetic: a few
units in the last place of float64, scaled by the size of the values
involved. The same inputs are not the same sort everywhere, though: where
NumPy has no vectorized sort for the CPU, `np.argsort` orders a row of up to
16 values by insertion, which keeps equal values in id order, so an answer
with an unstable sort is right on every short row. The routing puzzle
therefore also draws rows of 17 to 24 experts with ties, on which such an
answer fails on every machine.

## In a notebook

Every puzzle is a notebook, `examples/puzzles/NN_name.ipynb`: the task, the
rules, a stub that raises `NotImplementedError`, a one-line check, a hint and
the answer, the last two collapsed. The one-line check is `puzzle.run(fn)`,
which prints the verdict and never raises, so a notebook shows a message,
not a traceback, whatever the answer does: on the stub it says that the function is not written yet
(`check` raises `NotWrittenYet`, a `PuzzleFailure`, for it); on a wrong answer
it prints the teaching message; on a right one, what was checked.

```python
from refimpl.testing.puzzles import PUZZLES

puzzle = PUZZLES["routing"]
print(puzzle.spec)                 # the task, with its equation
puzzle.run(my_route_with_bias)     # prints the verdict
puzzle.check(my_route_with_bias)   # the same, raising PuzzleFailure when wrong (for a test)
```

Each puzzle's `solution` is a readable answer in NumPy alone; the tests of
this module check that every solution passes, that every stub is reported as
not written, and that wrong answers written the way ports wrote them are
named for their mistake.
"""

from __future__ import annotations

from refimpl.testing.puzzles.balancing import CUTOFFS, DUAL_STEP, QB_UPDATE, SIGN_RULE
from refimpl.testing.puzzles.capacity import CAPACITY
from refimpl.testing.puzzles.core import (
    Case,
    Mistake,
    NotWrittenYet,
    Puzzle,
    PuzzleFailure,
    PuzzlePassed,
    Trial,
)
from refimpl.testing.puzzles.histogram import HISTOGRAM_QUANTILE
from refimpl.testing.puzzles.layer import LATENT_FORWARD, MIXTURE_WEIGHTS, ROUTING, SITU_GLU

__all__ = [
    "PUZZLES",
    "Case",
    "Mistake",
    "NotWrittenYet",
    "Puzzle",
    "PuzzleFailure",
    "PuzzlePassed",
    "Trial",
]


#: The puzzles by name, in reading order: from Eq. (13) through Eq. (12), (11), (14) and Appendices C and D.
PUZZLES: dict[str, Puzzle] = {p.name: p for p in (
    ROUTING, MIXTURE_WEIGHTS, SITU_GLU, LATENT_FORWARD, CUTOFFS, QB_UPDATE, DUAL_STEP, SIGN_RULE,
    HISTOGRAM_QUANTILE, CAPACITY)}

