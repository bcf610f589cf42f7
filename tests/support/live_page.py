"""What the live page's API serves, decoded as the page decodes it."""
from __future__ import annotations

import base64
import json
import math
from array import array
from typing import Any


def decoded(data: dict) -> dict:
    """/api/history's series as the page decodes them: float64 from base64, null if NaN/Inf."""
    assert data["encoding"] == "float64-le-base64"
    series = {name: [v if math.isfinite(v) else None
                     for v in array("d", base64.b64decode(column))]
              for name, column in data["series"].items()}
    return {**data, "series": series}


def strict_json(body: bytes | str) -> Any:
    """`body` parsed as JSON proper: NaN, Infinity and -Infinity (which Python's json writes
    and reads by default, a browser's JSON.parse rejects) raise ValueError."""
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(body, parse_constant=refuse)
