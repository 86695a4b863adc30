"""The MoE report card: computed cells agree with hand-computed counts; unknown cells give a reason."""

from __future__ import annotations

import re

from refimpl.studies.report_card import ITEMS, report_card, report_card_entries


def test_every_design_answers_every_item_or_says_why_not():
    entries = report_card_entries()
    assert list(entries) == ["Kimi K3", "DeepSeek-V3", "DeepSeek-V4 Flash", "DeepSeek-V4 Pro",
                             "Switch Transformer", "LatentMoE (K3 sizes, no norm)"]
    for row in entries.values():
        assert list(row) == list(ITEMS)
        for entry in row.values():
            assert len(entry.text) > 10  # a statement with its source, or the reason it is unknown
            if entry.known:  # a stated cell names where it comes from
                assert re.search(r"\[(K3|chapter|V3|Switch|LatentMoE|computed|computed from the preset)\]",
                                 entry.text), entry.text


def test_computed_counts_match_hand_computed_values():
    entries = report_card_entries()
    # K3's routed parameters, 3 l f n over 92 layers, written out.
    assert "2,722,740,830,208" in entries["Kimi K3"][ITEMS[0]].text
    # DeepSeek-V3: 256 experts of 3 * 7168 * 2048 over 58 MoE layers.
    assert f"{256 * 3 * 7168 * 2048 * 58:,}" in entries["DeepSeek-V3"][ITEMS[0]].text
    # DeepSeek-V4: per unit of width, 256 (384) experts of 3 * 2048 (3072), and 6 + 1 experts activated.
    assert f"{256 * 3 * 2048:,} d routed, {7 * 3 * 2048:,} d activated" in entries["DeepSeek-V4 Flash"][ITEMS[0]].text
    assert f"{384 * 3 * 3072:,} d routed, {7 * 3 * 3072:,} d activated" in entries["DeepSeek-V4 Pro"][ITEMS[0]].text
    # Payload: k l for K3, k d for V3, both 57,344.
    assert f"{16 * 3584:,} values" in entries["Kimi K3"][ITEMS[6]].text
    assert f"{8 * 7168:,} values" in entries["DeepSeek-V3"][ITEMS[6]].text
    # MXFP4 memory of one K3 layer: 29,595,009,024 weights at 4.25 bits.
    assert f"{29_595_009_024 * 4.25 / 8 / 1e9:.1f} GB per layer" in entries["Kimi K3"][ITEMS[8]].text


def test_markdown_table_shape_and_unknown_count():
    text = report_card()
    rows = [line for line in text.splitlines() if line.startswith("| **")]
    assert len(rows) == len(ITEMS)
    assert all(row.count(" | ") == 6 for row in rows)  # the item and six designs
    entries = report_card_entries()
    unknown = sum(not e.known for row in entries.values() for e in row.values())
    assert text.count("*unknown: ") == unknown
    assert f"{unknown} are unknown" in text
