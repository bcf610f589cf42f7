"""Files that a test and a running process hand each other while both run (imported by the
scripts beside it as `handover`, by the tests as `tests.support.scripts.handover`)."""
from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` so that a process polling for the file sees all of it or none:
    a reader that checks `exists()` and then reads a plain `write_text` can read it empty
    (a rank crashed on `int('')` that way). A hidden temporary file, then a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
