"""Result files: `loadtests.report.dumps` keeps the data and puts each list of numbers on one line."""

from __future__ import annotations

import json

from loadtests.report import dumps


def test_dumps_keeps_the_data_and_puts_number_lists_on_one_line() -> None:
    doc = {"token_ids": [[1, 2, 3], [40, -5]], "ratios": [0.97, 1.0, 1e-05], "empty": [],
           "mixed": [1, "x", None], "config": '{"draft_min_token_prob":[0.35,0.15]}',
           "nested": {"per_round": [1.5, 2.5], "label": "[1,\n2]"}}
    text = dumps(doc)
    assert json.loads(text) == doc
    lines = text.splitlines()
    assert ' "ratios": [0.97, 1.0, 1e-05],' in lines and "  [1, 2, 3]," in lines
    assert '"config": "{\\"draft_min_token_prob\\":[0.35,0.15]}"' in text  # strings untouched
    assert len(lines) < len(json.dumps(doc, indent=1).splitlines()) - 8
