"""`specserve bench structured`: runs its variants through the real engine, prints the table and writes a
JSON whose ratios come from its rounds; the extraction outputs with and without ngram are compared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.structured import INVOICE, invoice
from server.cli import main


def test_bench_structured_writes_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    rc = main(["bench", "structured", "--rounds", "2", "--num-prompts", "2", "--concurrency", "2",
               "--max-tokens", "6", "--extract-tokens", "30", "--output", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "JSON schema, 2 in flight" in printed and "identical with and without ngram: True" in printed
    doc = json.loads(out.read_text())
    rounds = doc["rounds"]
    assert len(rounds) == 2 and all(r["extract_same_tokens"] for r in rounds)
    each = sorted(r["json@2"] / r["free@2"] for r in rounds)
    assert doc["ratios"]["mask_cost@2"] == pytest.approx((each[0] + each[1]) / 2)
    each = sorted(r["extract_ngram_compact"] / r["extract_plain_compact"] for r in rounds)
    assert doc["ratios"]["extract_compact_ngram_vs_plain"] == pytest.approx((each[0] + each[1]) / 2)
    assert set(doc["median_tokens_per_s"]) >= {"free@1", "json@2", "extract_plain", "extract_ngram_compact"}


def test_invoices_hold_what_the_schema_asks_for() -> None:
    import random

    text = invoice(random.Random(3))
    assert text.startswith("INVOICE INV-") and "Bill to:" in text and text.count("SKU ") >= 4
    assert set(INVOICE["required"]) == {"invoice_id", "customer", "address", "items"}
