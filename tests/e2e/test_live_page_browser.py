"""The live page in a real browser: Debian's chromium driven by Playwright, against a real
MindSpore run (CPU) whose endpoint has basic auth and whose loss goes NaN at step K.

Chromium is the system binary (tests/support/browser.py). Each browser gets a fresh
temporary profile (Playwright's own `--user-data-dir`). The screenshot is saved under
pytest's temporary directory; its path is printed (`pytest -s` shows it).
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import bcrypt
import pytest

from mfotel.localstack.servers import free_port
from tests.support.browser import BROWSER_TIMEOUT_MS, chromium, js
from tests.support.http import basic_auth, get
from tests.support.live_page import strict_json
from tests.support.metrics import samples, value
from tests.support.waiting import settle, startup, wait_for

pytestmark = pytest.mark.slow

USER, PASSWORD = "viewer", "live-page-pw"
POLL_SECONDS = 1.0  # the page polls api/history once a second (mfotel/ui/static/app.js)
STEPS, NAN_AT_STEP, STEP_SLEEP = 600, 150, 0.04
TRAIN = f"""
import sys
from mfotel.demo.training import run_demo
port, web_config = int(sys.argv[1]), sys.argv[2]
run_demo(steps={STEPS}, step_interval=1, port=port, nan_at_step={NAN_AT_STEP},
         min_step_seconds={STEP_SLEEP},
         output={{"console": False}},
         prometheus={{"host": "127.0.0.1", "port": port, "web_config_file": web_config,
                     "linger_seconds": 300, "linger_until_scraped": False}})
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Iterator[str]:
    """A real training process serving the page with basic auth; its base URL."""
    work = tmp_path_factory.mktemp("live-run")
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    (work / "web.yml").write_text(f"basic_auth_users:\n  {USER}: '{hashed}'\n")
    port = free_port()
    log = (work / "train.log").open("w")
    process = subprocess.Popen([sys.executable, "-c", TRAIN, str(port), str(work / "web.yml")],
                               cwd=work, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "GLOG_v": "3"})
    base = f"http://127.0.0.1:{port}"

    def serving() -> bool:
        assert process.poll() is None, (work / "train.log").read_text()[-3000:]
        return get(base + "/", timeout=2).status == 401
    try:
        wait_for(serving, startup(), 0.2, "the training process to serve its page",
                 ignore=(OSError,))
        yield base
    finally:
        process.kill()
        process.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as launched:
        yield launched


@pytest.fixture(scope="module")
def page(run, browser) -> Iterator[Any]:
    """The page opened with the credentials; console errors collected in page.problems."""
    context = browser.new_context(http_credentials={"username": USER, "password": PASSWORD},
                                  viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(BROWSER_TIMEOUT_MS)
    tab = context.new_page()
    tab.problems = []
    # (the pixel reads of these tests make Chromium advise willReadFrequently: not the page's)
    tab.on("console", lambda m: tab.problems.append(f"{m.type}: {m.text}")
           if m.type in ("error", "warning") and "willReadFrequently" not in m.text else None)
    tab.on("pageerror", lambda e: tab.problems.append(f"pageerror: {e}"))
    response = tab.goto(run + "/")
    assert response.status == 200
    yield tab
    context.close()


def current_step(page: Any) -> int | None:
    text = js(page, "document.getElementById('step').textContent")
    return int(text) if text.isdigit() else None


def plot_pixels(page: Any, chart: str, rgb: tuple[int, int, int], tolerance: int = 40) -> int:
    """Pixels of `chart`'s plot area within `tolerance` of `rgb` (the line's colour)."""
    return js(page, f"""(() => {{
        const u = window.mfotel.charts[{chart!r}];
        const {{left, top, width, height}} = u.bbox;
        const d = u.ctx.getImageData(left, top, width, height).data;
        let n = 0;
        for (let i = 0; i < d.length; i += 4) {{
            if (d[i + 3] > 128 && Math.abs(d[i] - {rgb[0]}) < {tolerance}
                && Math.abs(d[i + 1] - {rgb[1]}) < {tolerance}
                && Math.abs(d[i + 2] - {rgb[2]}) < {tolerance}) n++;
        }}
        return n;
    }})()""")


def test_without_credentials_the_page_answers_401(run, browser):
    assert get(run + "/api/history", timeout=60).status == 401
    from playwright.sync_api import Error
    # a browser without credentials gets the 401 challenge (headless: no dialog, no page);
    # with wrong ones it gives up after the retry and shows the 401 answer
    context = browser.new_context()
    context.set_default_timeout(BROWSER_TIMEOUT_MS)
    try:
        with pytest.raises(Error, match="ERR_INVALID_AUTH_CREDENTIALS"):
            context.new_page().goto(run + "/")
    finally:
        context.close()
    context = browser.new_context(http_credentials={"username": USER, "password": "not-it"})
    context.set_default_timeout(BROWSER_TIMEOUT_MS)
    try:
        tab = context.new_page()
        response = tab.goto(run + "/")
        assert response.status == 401 and tab.content().count("Unauthorized") == 1
    finally:
        context.close()
    assert get(run + "/api/history", auth=basic_auth(USER, "not-it"), timeout=60).status == 401


def test_the_charts_render_and_the_step_counter_advances_while_training(page):
    first = wait_for(lambda: current_step(page), startup(), 0.2, "the first step on the page")
    later = wait_for(lambda: (current_step(page) or 0) > first and current_step(page),
                     settle(POLL_SECONDS), 0.2, "the step counter to advance")
    assert first < later < STEPS
    assert js(page, "document.getElementById('status').textContent") == "running"
    charts = js(page, "Object.keys(window.mfotel.charts)")
    assert sorted(charts) == sorted(["loss", "learning_rate", "grad_norm", "throughput",
                                     "step_time"])
    assert js(page, "document.querySelectorAll('#charts canvas').length") == 5
    colours = {"loss": (0x25, 0x63, 0xEB), "learning_rate": (0x7C, 0x3A, 0xED),
               "grad_norm": (0x05, 0x96, 0x69), "throughput": (0xD9, 0x77, 0x06),
               "step_time": (0x08, 0x91, 0xB2)}
    for chart, rgb in colours.items():   # each line is drawn: its colour fills pixels
        assert plot_pixels(page, chart, rgb) > 50, chart
    # a first step (graph compilation) that dwarfs the others is off the step-time scale,
    # and said so (a loaded machine may have slowed a later step as much: then it is not)
    first, others, top, note = js(page, """[window.mfotel.series.step_time[0],
        Math.max(...window.mfotel.series.step_time.slice(1).filter(v => v !== null)),
        window.mfotel.charts.step_time.scales.y.max,
        document.getElementById('note-step_time').textContent]""")
    if first > 3 * others:
        assert top < first and note.startswith("first step ")
        assert note.endswith("(includes graph compilation), off the scale")
    else:
        assert top >= first and note == ""
    assert page.problems == []           # no CSP violation, no script error


def test_a_nan_at_step_k_is_marked_on_the_page(page, tmp_path_factory):
    # the page shows the step counter first, then draws the charts: two more polls
    wait_for(lambda: (current_step(page) or 0) >= NAN_AT_STEP + 20,
             settle(STEP_SLEEP * (NAN_AT_STEP + 20), POLL_SECONDS), 0.2,
             f"step {NAN_AT_STEP + 20} on the page")
    polls = js(page, "window.mfotel.polls")
    wait_for(lambda: js(page, "window.mfotel.polls") >= polls + 2, settle(2 * POLL_SECONDS), 0.2,
             "two more polls of the page")
    alert = js(page, "document.getElementById('alert').textContent")
    assert f"The loss went NaN at step {NAN_AT_STEP}" in alert
    assert not js(page, "document.getElementById('alert').hidden")
    marks = js(page, "[...document.querySelectorAll('#marks-list li')].map(li => li.textContent)")
    assert any(m.startswith(f"loss: steps {NAN_AT_STEP}–") and m.endswith("(NaN)") for m in marks)
    loss_card = js(page, "document.querySelector('#current .card.bad .value').textContent")
    assert loss_card == "NaN"
    # the page shows what /metrics shows (NaN as it is); its API answers strict JSON, where
    # the NaN loss is null and nonfinite_values names it
    metrics, summary, numbers = js(page, """Promise.all(
        ['metrics', 'api/summary', 'api/history?format=numbers'].map(
            (path) => fetch(path, { cache: 'no-store' }).then((r) => r.text())))""")
    assert math.isnan(value(samples(metrics), "mindformers_train_loss"))
    assert math.isnan(value(samples(metrics), "mindformers_train_grad_norm"))
    current = strict_json(summary)
    assert current["loss"] is None and current["loss_finite"] == 0
    assert current["nonfinite_values"] == {"loss": "NaN", "grad_norm": "NaN"}
    series = strict_json(numbers)["series"]["loss"]
    assert series[-1] is None and series[NAN_AT_STEP // 2] is not None
    assert js(page, "window.mfotel.current.nonfinite_values.loss") == "NaN"
    row = wait_for(lambda: js(page, """[...document.querySelectorAll('#overview-rows tr')]
        .map((tr) => [...tr.children].map((td) => td.textContent))[0]"""),
                   settle(2 * POLL_SECONDS), 0.2, "this rank's row in the ranks table")
    assert row[3] == "NaN" and row[4] == "NaN", row   # loss and grad norm columns
    # the first non-finite step is a red line on the charts, at step K's x position
    red = js(page, f"""(() => {{
        const u = window.mfotel.charts.loss;
        const x = Math.round(u.valToPos({NAN_AT_STEP}, 'x', true));
        const y = Math.round(u.bbox.top + u.bbox.height / 2);
        return Array.from(u.ctx.getImageData(x, y, 1, 1).data);
    }})()""")
    assert red[0] > 180 and red[1] < 90 and red[2] < 90 and red[3] > 200, red
    before = js(page, f"""(() => {{
        const u = window.mfotel.charts.loss;
        const x = Math.round(u.valToPos({NAN_AT_STEP // 2}, 'x', true));
        return Array.from(u.ctx.getImageData(x, u.bbox.top + 2, 1, 1).data);
    }})()""")
    assert before[3] < 100, before   # no mark before the NaN
    shot = tmp_path_factory.mktemp("screenshots") / "live-page.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"\nlive page screenshot: {shot}")
    assert shot.stat().st_size > 20_000
    assert page.problems == []


def test_the_loss_chart_switches_to_a_log_scale(page):
    assert js(page, "window.mfotel.charts.loss.scales.y.distr") == 1
    page.click("#loss-log")
    assert js(page, "window.mfotel.charts.loss.scales.y.distr") == 3
    assert plot_pixels(page, "loss", (0x25, 0x63, 0xEB)) > 50
    page.click("#loss-log")
    assert js(page, "window.mfotel.charts.loss.scales.y.distr") == 1
    assert page.problems == []


def test_the_header_and_the_ranks_table_show_one_age(run, browser):
    """After the last step the header ("last step ... ago") and this rank's row of the ranks
    table count from the same clock: the rank's, not the browser's (here ten minutes fast),
    and keep counting together."""
    import datetime
    context = browser.new_context(http_credentials={"username": USER, "password": PASSWORD})
    context.set_default_timeout(BROWSER_TIMEOUT_MS)
    try:
        tab = context.new_page()
        fast = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=10)
        tab.clock.set_fixed_time(fast)
        assert tab.goto(run + "/").status == 200
        wait_for(lambda: js(tab, "document.getElementById('status').textContent") ==
                 "completed", settle(300), 0.2, "the run to complete")

        def ages() -> tuple[str, str] | None:
            header, row = js(tab, "[document.getElementById('updated').textContent, "
                                  "(document.querySelector('#overview-rows tr.self "
                                  "td:nth-child(8)') || {}).textContent]")
            return (header, row) if row else None
        header, row = wait_for(ages, settle(30), 0.2, "this rank's row in the ranks table")
        assert header == f"last step {row}", (header, row)
        assert re.fullmatch(r"\d+\.\d s ago", row), row          # seconds, not 10 minutes
        later = wait_for(lambda: (ages() or (0, row))[1] != row and ages(), settle(30), 0.2,
                         "the ages to advance")
        assert later[0] == f"last step {later[1]}"
        assert float(later[1].split()[0]) > float(row.split()[0])
    finally:
        context.close()
