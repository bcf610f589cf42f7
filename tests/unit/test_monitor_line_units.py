"""The monitor line prints its units; the log parser reads lines with and without them."""
from __future__ import annotations

from mfotel.logs.parse import parse_file
from mfotel.sinks import format_line


def test_text_line_prints_units_and_the_parser_reads_them_back(tmp_path):
    line = format_line(50, {"loss": 2.5, "throughput": 65.4, "step_time": 0.122})
    assert line.startswith("[Monitor] step: 50, loss: 2.5, throughput: 65.4 samples/s, "
                           "step_time: 0.122 s")
    new, old = tmp_path / "new.log", tmp_path / "old.log"
    new.write_text(line + "\n")
    old.write_text("[Monitor] step: 51, throughput: 12.5, step_time: 0.5\n")  # before units
    assert [(r.step, r.throughput, r.step_time) for r in parse_file(new)] == [(50, 65.4, 0.122)]
    assert [(r.step, r.throughput, r.step_time) for r in parse_file(old)] == [(51, 12.5, 0.5)]
