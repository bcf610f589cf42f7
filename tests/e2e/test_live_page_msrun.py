"""Rank 0's live page shows both ranks of a real 2-rank data-parallel msrun job (CPU), in
Debian's chromium driven by Playwright (tests/support/browser.py)."""
from __future__ import annotations

import pytest

from mfotel.localstack.servers import free_port, free_port_block
from mfotel.ui.overview import MIN_INTERVAL_SECONDS
from tests.support.browser import BROWSER_TIMEOUT_MS, chromium, js
from tests.support.http import get_json
from tests.support.multirank import child_env, msrun_command, start, stop
from tests.support.waiting import msrun_startup, settle, wait_for

pytestmark = pytest.mark.slow
OVERVIEW_POLL_SECONDS = 2.0  # the page polls api/overview every 2 s (mfotel/ui/static/app.js)


def overview(url: str) -> dict:
    try:
        return get_json(url + "api/overview", timeout=5)
    except OSError:
        return {}


def test_rank_0s_page_shows_both_ranks_of_an_msrun_job(tmp_path):
    base = free_port_block(2)
    # it trains until stopped: on a loaded machine 400 steps ended before the browser came up
    args = ["--steps", "100000", "--port", str(base), "--job-name", "live-dp",
            "--step-sleep", "0.05", "--log-rank", "0"]
    run = start(msrun_command(args, free_port(), tmp_path / "logs"), child_env(),
                tmp_path / "msrun.log", tmp_path)
    rank0 = f"http://127.0.0.1:{base}/"
    try:
        seen = wait_for(lambda: (d := overview(rank0)).get("ranks") and len(d["ranks"]) == 2
                        and all((r.get("step") or 0) > 0 for r in d["ranks"]) and d,
                        msrun_startup() + settle(MIN_INTERVAL_SECONDS), 0.5,
                        "both ranks on rank 0's overview", alive=[run],
                        details=lambda: "\n".join(
                            p.read_text(errors="replace")[-2000:] for p in
                            [tmp_path / "msrun.log", *sorted(tmp_path.glob("logs/*.log"))]))
        assert [r["rank"] for r in seen["ranks"]] == [0, 1] and seen["note"] is None
        assert seen["ranks"][1]["url"] == f"http://127.0.0.1:{base + 1}/"
        assert {r["status_name"] for r in seen["ranks"]} == {"running"}
        rank1 = overview(f"http://127.0.0.1:{base + 1}/")
        assert rank1["enabled"] is False and rank1["url"] == rank0
        with chromium() as browser:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(BROWSER_TIMEOUT_MS)
            page.goto(rank0)
            rows = wait_for(lambda: js(page, "[...document.querySelectorAll("
                                       "'#overview-rows tr')].map(tr => tr.textContent)"),
                            settle(OVERVIEW_POLL_SECONDS),
                            message="the overview table in the browser")
            assert len(rows) == 2
            assert rows[0].startswith("0running") and rows[1].startswith("1running")
            counts = js(page, "document.getElementById('overview-counts').textContent")
            assert counts == "2 of 2 ranks: 2 running"
            link = js(page, "document.querySelector('#overview-rows tr:nth-child(2) a').href")
            assert link == f"http://127.0.0.1:{base + 1}/"
            page.screenshot(path=str(tmp_path / "rank0-overview.png"), full_page=True)
            print(f"\nrank 0's page: {tmp_path / 'rank0-overview.png'}")
    finally:
        stop(run)
