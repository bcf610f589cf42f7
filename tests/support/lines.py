"""Read the monitor lines mfotel writes (console and file)."""
from __future__ import annotations

import re
from datetime import datetime

ISO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d")


def split_time(line: str) -> tuple[str, float]:
    """(the line before its time field, the unix time the field says)."""
    head, sep, stamp = line.rpartition(", time: ")
    assert sep and ISO_TIME.fullmatch(stamp), line
    return head, datetime.fromisoformat(stamp).timestamp()
