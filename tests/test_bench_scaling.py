"""The scaling table of benchmarks/bench_scaling.py (issue 39) from rows: speed-ups over the one-GPU row, the
efficiency, the peer column, and the bars of B8xT1024 (>= 1.97x on 2 GPUs, 3.9x on 4, 7.6x on 8)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_scaling as S  # noqa: E402


def _row(config, n, tok_s, torch=None):
    return dict(config=config, n=n, ms=8192 * n / tok_s * 1e3, tok_s=tok_s, peak_gib=30.0, torch=torch)


def test_speed_ups_and_bars():
    rows = [_row("b8t1024", 1, 70000.0), _row("b8t1024", 2, 138000.0, dict(tok_s=84000.0)),
            _row("b8t1024", 4, 270000.0), _row("b4t64", 1, 15800.0), _row("b4t64", 2, 25900.0)]
    lines, ok = S.table(dict(rows=rows))
    text = "\n".join(lines)
    assert "1.97x  0.986" in text and ">= 1.97x PASS" in text  # 138000 / 70000 = 1.971
    assert "3.86x  0.964" in text and ">= 3.9x FAIL" in text  # 270000 / 70000 = 3.857
    assert "84,000" in text and "1.64x" in text  # the peer's tok/s and ours over it
    assert "1.64x  0.820" in text  # b4t64: 25900 / 15800, no bar
    assert not ok
    ok_rows = [r for r in rows if r["n"] != 4]
    assert S.table(dict(rows=ok_rows))[1]


def test_without_a_one_gpu_row_there_is_no_speed_up_and_no_verdict():
    lines, ok = S.table(dict(rows=[_row("b8t1024", 2, 100000.0)]))
    assert ok and "PASS" not in "\n".join(lines) and "FAIL" not in "\n".join(lines)
