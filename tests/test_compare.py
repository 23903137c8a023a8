"""``compare A B`` (launcher/reports/compare.py) over two sides' figures: pure; what it reads
from a real server's records is in tests/test_watch.py."""

from __future__ import annotations

import dataclasses
from typing import Any

from launcher.reports import compare
from launcher.watch import record


def side(generation: int, **figures: Any) -> dict[str, Any]:
    """A side with enough data to compare (40 requests over 8 samples), ``figures`` changed."""
    enough = {"requests": 40, "completions": 40, "samples": 8, "decode_tokens": 640}
    given = {**enough, "decode_tps": 80.0, **figures}
    summary = dataclasses.replace(record.summarize(generation, []), **given).to_dict()
    return {
        "generation": generation,
        "outcome": "deployed",
        "argv": ["-m", "m.gguf", "-t", str(generation)],
        "summary": summary,
        "lacks": compare.lacks(summary),
    }


def test_a_side_that_decoded_nothing_is_compared_without_a_ratio() -> None:
    # A's counters say it spent seconds on decoding and produced no token: 0 tok/s
    d = compare.side_by_side("u.service", side(1, decode_tokens=0, decode_tps=0.0), side(2))
    assert d["enough"], d["verdict"]
    decode = next(r for r in d["figures"] if r["field"] == "decode_tps")
    assert (decode["a"], decode["b"], decode["ratio"]) == (0.0, 80.0, None)
    assert d["verdict"].startswith("generation 2 against 1: decode 80.0 tok/s, generation 1 ")
    assert "decoded nothing" in d["verdict"]
    text = compare.compare_text(d)
    assert "None" not in text and "decoded nothing" in text


def test_two_sides_that_decoded_compare_by_their_ratio() -> None:
    d = compare.side_by_side("u.service", side(1), side(2, decode_tps=100.0))
    assert d["verdict"].startswith("generation 2 against 1: decode 1.25x of generation 1's")
