"""tools/eval_tiny_vlm.py's paired int8-vs-fp32 comparison."""
from __future__ import annotations

import math

from tools.eval_tiny_vlm import agreement


def test_agreement_counts_discordant_pairs_and_their_standard_error():
    # 10 read questions at low: fp32 right on 0-3, int8 right on 2-4; answers differ on 0, 1, 4
    fp32 = {(s, "low", 0, "read"): ("ok" if s < 4 else f"x{s}", s < 4) for s in range(10)}
    int8 = {(s, "low", 0, "read"): ("ok" if 2 <= s <= 4 else
                                    ("bad" if s < 2 else f"x{s}"), 2 <= s <= 4) for s in range(10)}
    cell = agreement(fp32, int8)["low"]["read"]
    assert cell["n"] == 10 and cell["fp32_only"] == 2 and cell["int8_only"] == 1
    assert cell["agree"] == 70.0
    assert cell["delta"] == -10.0  # 3 of 10 right in int8, 4 of 10 in fp32
    assert math.isclose(cell["delta_se"], round(100 * math.sqrt(3 - 1 / 10) / 10, 2))
