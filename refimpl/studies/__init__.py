r"""What the worked examples and the study pages share: recorded runs, figures, a workload and the report card.

| module | what it holds |
|---|---|
| `refimpl.studies.recorded` | the recorded long training runs that examples 61-63 and 73 print, plot and replay |
| `refimpl.studies.figures` | how an example saves its figures, or shows them under a notebook cell |
| `refimpl.studies.workloads` | the skewed router and fresh batches of the "Balance is speed" examples |
| `refimpl.studies.report_card` | the MoE report card, computed from the configurations it describes |

None of it is part of the layer; it is here so that an example (or its
notebook, run in an empty folder) finds the same data wherever refimpl is
installed.
"""

from __future__ import annotations

from . import figures, recorded, report_card, workloads

__all__ = ["figures", "recorded", "report_card", "workloads"]
