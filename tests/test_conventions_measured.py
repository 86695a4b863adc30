"""The conventions page's measured table says what the pinned transformers does, and each probe can tell."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import measure_conventions  # noqa: E402 - the script lives with the docs it writes for

pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op:UserWarning")


def test_the_committed_record_is_what_the_pinned_transformers_does_now():
    measured = measure_conventions.measure()
    committed = json.loads(measure_conventions.RECORD.read_text(encoding="utf-8"))
    assert measured == committed, ("the measured conventions differ from docs/pages/conventions_measured.json: "
                                   "run `.venv/bin/python docs/measure_conventions.py write` and read the diff")


def test_every_family_reads_and_every_row_has_a_cell():
    from refimpl.families import FAMILIES

    record = json.loads(measure_conventions.RECORD.read_text(encoding="utf-8"))
    assert set(record["families"]) == set(FAMILIES)
    for cells in record["families"].values():
        assert list(cells) == list(record["rows"])
        assert "none of them" not in cells.values()


def test_a_probe_names_the_other_convention_when_the_block_has_it(monkeypatch):
    """A DeepSeek-V3 block whose router subtracts the bias is measured as s - b, and one masking with 0 is seen."""
    import torch
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as dsv3

    original = dsv3.DeepseekV3TopkRouter.forward if hasattr(dsv3, "DeepseekV3TopkRouter") else None
    assert original is not None

    def subtracting(self, hidden_states):
        with torch.no_grad():
            self.e_score_correction_bias.neg_()
        try:
            return original(self, hidden_states)
        finally:
            with torch.no_grad():
                self.e_score_correction_bias.neg_()

    monkeypatch.setattr(dsv3.DeepseekV3TopkRouter, "forward", subtracting)
    cells = measure_conventions.measure_family("deepseek_v3")
    assert cells["selection"] == "s - b"
    assert cells["scores"] == "sigmoid"  # top-k of every expert: the sign of the bias cannot matter there


def test_the_table_renders_every_family_as_a_row():
    """A row per family and a column per convention: the conventions are few, so the table fits the page."""
    record = json.loads(measure_conventions.RECORD.read_text(encoding="utf-8"))
    table = measure_conventions.markdown(record).splitlines()
    assert len(table) == 2 + len(record["families"])
    assert all(line.count("|") == len(record["rows"]) + 2 for line in table)
    for line, (name, cells) in zip(table[2:], record["families"].items(), strict=True):
        assert line == f"| `{name}` | " + " | ".join(cells[row] for row in record["rows"]) + " |"
