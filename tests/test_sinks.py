"""Monitor line formats (text as the seed writes it, strict JSON lines)."""
from __future__ import annotations

import json

from mfotel.sinks import FileSink, format_json, format_line


def test_seed_line_format():
    line = format_line(50, {"loss": 2.345, "learning_rate": 1e-5, "grad_norm": 0.876})
    assert line == "[Monitor] step: 50, loss: 2.345, learning_rate: 1.000000e-05, grad_norm: 0.876"


def test_line_keeps_metric_order_skips_missing_and_shows_nan():
    line = format_line(7, {"grad_norm": float("inf"), "loss": float("nan"), "throughput": None})
    assert line == "[Monitor] step: 7, grad_norm: inf, loss: nan"


def test_json_line_is_strict_json_with_nonfinite_as_strings():
    text = format_json(3, 1, 2, "job", {"loss": float("nan"), "learning_rate": 0.001,
                                         "grad_norm": float("-inf")}, now=10.0)
    record = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert record == {"time": 10.0, "job_name": "job", "rank": 2, "step": 3, "epoch": 1,
                      "loss": "nan", "learning_rate": 0.001, "grad_norm": "-inf"}


def test_file_sink_appends_flushed_lines(tmp_path):
    path = tmp_path / "deep" / "m.log"
    sink = FileSink(path)
    sink.write("a")
    assert path.read_text() == "a\n"  # flushed before close
    sink.write("b")
    sink.close()
    assert FileSink(path) and path.read_text() == "a\nb\n"
