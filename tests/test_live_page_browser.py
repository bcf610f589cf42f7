"""The live page in a real browser: Debian's chromium driven by Playwright, against a real
MindSpore run (CPU) whose endpoint has basic auth and whose loss goes NaN at step K.

Chromium is the system binary (`scripts/bootstrap.sh test` installs Debian's `chromium`);
Playwright is pointed at it and never downloads a browser. Each browser gets a fresh
temporary profile (Playwright's own `--user-data-dir`). The screenshot is saved under
pytest's temporary directory; its path is printed (`pytest -s` shows it).
"""
from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import bcrypt
import pytest

from mfotel.demo.stack import free_port

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
USER, PASSWORD = "viewer", "live-page-pw"
STEPS, NAN_AT_STEP, STEP_SLEEP = 600, 150, 0.04
TRAIN = """
import sys
from mfotel.demo.training import run_demo
port, web_config = int(sys.argv[1]), sys.argv[2]
run_demo(steps={steps}, step_interval=1, port=port, nan_at_step={nan}, min_step_seconds={sleep},
         output={{"console": False}},
         prometheus={{"host": "127.0.0.1", "port": port, "web_config_file": web_config,
                     "linger_seconds": 300, "linger_until_scraped": False}})
""".format(steps=STEPS, nan=NAN_AT_STEP, sleep=STEP_SLEEP)


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Poll `probe` until it returns something truthy (bounded); fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


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
        try:
            urllib.request.urlopen(base + "/", timeout=2)
        except urllib.error.HTTPError as exc:
            return exc.code == 401
        except OSError:
            return False
        return True
    try:
        wait_for("the training process to serve its page", serving, timeout=120)
        yield base
    finally:
        process.kill()
        process.wait(timeout=30)
        log.close()


#: Playwright's waits (navigation, clicks), generous: the machine may be heavily loaded
BROWSER_TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium "
                    f"(scripts/bootstrap.sh test does, or apt-get install chromium)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


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


def js(page: Any, expression: str) -> Any:
    """Evaluate `() => expression` (over CDP, which the page's CSP does not restrict)."""
    return page.evaluate(f"() => {expression}")


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
    request = urllib.request.Request(run + "/api/history")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 401
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
    wrong = base64.b64encode(f"{USER}:not-it".encode()).decode()
    request.add_header("Authorization", f"Basic {wrong}")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 401


def test_the_charts_render_and_the_step_counter_advances_while_training(page):
    first = wait_for("the first step on the page", lambda: current_step(page))
    later = wait_for("the step counter to advance",
                     lambda: (current_step(page) or 0) > first and current_step(page))
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
    wait_for(f"step {NAN_AT_STEP + 20}", lambda: (current_step(page) or 0) >= NAN_AT_STEP + 20)
    page.wait_for_timeout(1200)  # one more poll, so the charts have drawn the new points
    alert = js(page, "document.getElementById('alert').textContent")
    assert f"The loss went NaN at step {NAN_AT_STEP}" in alert
    assert not js(page, "document.getElementById('alert').hidden")
    marks = js(page, "[...document.querySelectorAll('#marks-list li')].map(li => li.textContent)")
    assert any(m.startswith(f"loss: steps {NAN_AT_STEP}–") and m.endswith("(NaN)") for m in marks)
    loss_card = js(page, "document.querySelector('#current .card.bad .value').textContent")
    assert loss_card == "NaN"
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
