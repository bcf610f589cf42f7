"""Rank 0's live page shows both ranks of a real 2-rank data-parallel msrun job (CPU), in
Debian's chromium driven by Playwright (see tests/test_live_page_browser.py)."""
from __future__ import annotations

import json
import urllib.request

import pytest

from mfotel.demo.stack import free_port, free_port_block
from multirank_support import child_env, msrun_command, start, stop, wait_until
from test_live_page_browser import BROWSER_TIMEOUT_MS, CHROMIUM, CHROMIUM_FLAGS, js

pytestmark = pytest.mark.slow


def overview(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "api/overview", timeout=5) as response:
            return json.loads(response.read())
    except OSError:
        return {}


def test_rank_0s_page_shows_both_ranks_of_an_msrun_job(tmp_path):
    from playwright.sync_api import sync_playwright
    base = free_port_block(2)
    args = ["--steps", "400", "--port", str(base), "--job-name", "live-dp",
            "--step-sleep", "0.05", "--log-rank", "0"]
    run = start(msrun_command(args, free_port(), tmp_path / "logs"), child_env(),
                tmp_path / "msrun.log", tmp_path)
    rank0 = f"http://127.0.0.1:{base}/"
    try:
        try:
            seen = wait_until(lambda: (d := overview(rank0)).get("ranks") and len(d["ranks"]) == 2
                              and all((r.get("step") or 0) > 0 for r in d["ranks"]) and d,
                              180, "both ranks on rank 0's overview", interval=0.5, alive=run)
        except (RuntimeError, TimeoutError) as exc:
            logs = "\n".join(p.read_text(errors="replace")[-2000:]
                             for p in [tmp_path / "msrun.log", *sorted(tmp_path.glob("logs/*.log"))])
            pytest.fail(f"{exc}\n{logs}")
        assert [r["rank"] for r in seen["ranks"]] == [0, 1] and seen["note"] is None
        assert seen["ranks"][1]["url"] == f"http://127.0.0.1:{base + 1}/"
        assert {r["status_name"] for r in seen["ranks"]} == {"running"}
        rank1 = overview(f"http://127.0.0.1:{base + 1}/")
        assert rank1["enabled"] is False and rank1["url"] == rank0
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(BROWSER_TIMEOUT_MS)
            page.goto(rank0)
            rows = wait_until(lambda: js(page, "[...document.querySelectorAll("
                                         "'#overview-rows tr')].map(tr => tr.textContent)"),
                              30, "the overview table in the browser")
            assert len(rows) == 2 and rows[0].startswith("0running") and rows[1].startswith("1running")
            counts = js(page, "document.getElementById('overview-counts').textContent")
            assert counts == "2 of 2 ranks: 2 running"
            link = js(page, "document.querySelector('#overview-rows tr:nth-child(2) a').href")
            assert link == f"http://127.0.0.1:{base + 1}/"
            page.screenshot(path=str(tmp_path / "rank0-overview.png"), full_page=True)
            print(f"\nrank 0's page: {tmp_path / 'rank0-overview.png'}")
            browser.close()
    finally:
        stop(run)
