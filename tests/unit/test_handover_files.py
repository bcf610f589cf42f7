"""scripts/handover.py: what a test hands a running process (and back) is read whole."""
from __future__ import annotations

import threading

from tests.support.scripts.handover import write_atomically


def test_a_reader_polling_for_the_file_never_reads_it_empty_or_in_part(tmp_path):
    path, text = tmp_path / "hold-1", "60" * 5000
    seen: list[str] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            if path.exists():
                seen.append(path.read_text())
                path.unlink()

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        for _ in range(500):
            write_atomically(path, text)
    finally:
        done.set()
        reader.join(10)
    assert seen and set(seen) == {text}
    assert [p.name for p in tmp_path.iterdir()] in ([], ["hold-1"])  # no temporary file left
