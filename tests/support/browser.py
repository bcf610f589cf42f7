"""A real browser for the live page: Debian's chromium driven by Playwright.

Chromium is the system binary (`scripts/bootstrap.sh test` installs Debian's `chromium`);
Playwright is pointed at it and never downloads a browser.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
#: Playwright's waits (navigation, clicks), generous: the machine may be heavily loaded
BROWSER_TIMEOUT_MS = 120_000


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless chromium (a Playwright Browser), closed on exit."""
    from playwright.sync_api import sync_playwright
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium "
                    f"(scripts/bootstrap.sh test does, or apt-get install chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            yield browser
        finally:
            browser.close()


def js(page: Any, expression: str) -> Any:
    """Evaluate `() => expression` (over CDP, which the page's CSP does not restrict)."""
    return page.evaluate(f"() => {expression}")
