"""Calls that must never block: run them under a watchdog, release what blocks them."""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


def bounded(call: Callable[[], Any], seconds: float, on_timeout: Callable[[], None] = lambda: None
            ) -> Any:
    """`call()` on a thread; AssertionError if it has not returned after `seconds` (a hang).

    `on_timeout` runs first, to release what blocks (e.g. open a FIFO's other end).
    """
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        on_timeout()
        thread.join(5)
        raise AssertionError(f"still running after {seconds} s: it blocks")
    if "error" in result:
        raise result["error"]
    return result.get("value")


def release_fifo(path: Path) -> Callable[[], None]:
    """A callable that opens the write end of the FIFO at `path` (unblocks a reader stuck in
    open()); for `bounded(..., on_timeout=release_fifo(path))`."""
    def open_writer() -> None:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    return open_writer
