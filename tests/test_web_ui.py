"""The web UI in a real headless browser (Debian's chromium driven by Selenium), against the
server on the default model with an API key: a streamed chat answer, the stop button
aborting a generation, and the dashboard updating while requests run; and, on a tiny model,
the dashboard's time series with and without latency targets. Screenshots go to
test-artifacts/ (or $KVSERVE_TEST_ARTIFACTS)."""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvserve.engine.llm_engine import EngineArgs
from tests.server_utils import run_server
from tests.test_cli import CHAT_QUESTION

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.real_model,
    pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                       reason="needs chromium and chromedriver (apt-get install chromium "
                              "chromium-driver; .ci/run installs them)"),
]
KEY = "ui-secret"
ARTIFACTS = Path(os.environ.get("KVSERVE_TEST_ARTIFACTS",
                                Path(__file__).resolve().parent.parent / "test-artifacts"))


@pytest.fixture(scope="module")
def server(real_model_path):
    args = EngineArgs(model=str(real_model_path), kv_cache_memory="256MiB")
    with run_server(args, api_key=KEY) as (url, _):
        yield url


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--window-size=1280,900", "--disable-gpu"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_script_timeout(60)
    yield driver
    driver.quit()


def wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def shot(driver, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def open_ui(driver, url: str, model: str = "SmolLM2-135M-Instruct") -> None:
    from selenium.webdriver.common.by import By

    driver.get(url + "/")
    key = driver.find_element(By.ID, "apikey")
    key.clear()
    key.send_keys(KEY)
    driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", key)
    wait_for(lambda: driver.find_element(By.ID, "model").text == model,
             what="the model name (needs the key)")


def test_chat_streams_an_answer(server, browser):
    from selenium.webdriver.common.by import By

    open_ui(browser, server)
    assert KEY not in browser.page_source.replace(f'value="{KEY}"', "")
    browser.find_element(By.ID, "temperature").clear()
    browser.find_element(By.ID, "temperature").send_keys("0")
    browser.find_element(By.ID, "prompt").send_keys(CHAT_QUESTION)
    browser.find_element(By.ID, "send").click()
    answer = wait_for(lambda: browser.find_element(By.ID, "stop").get_attribute("disabled")
                      and browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .timing")[-1]
                      .text, what="the streamed answer and its timings")
    text = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant span")[-1].text
    shot(browser, "chat")
    assert "Paris" in text
    assert "first token" in answer and "tokens/s" in answer


def test_stop_button_aborts_the_request(server, browser):
    from selenium.webdriver.common.by import By

    open_ui(browser, server)
    before = _aborts(server)
    browser.find_element(By.ID, "max_tokens").clear()
    browser.find_element(By.ID, "max_tokens").send_keys("1500")
    browser.find_element(By.ID, "prompt").send_keys("Write a very long story about a dragon.")
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant span")[-1].text)
             > 20, what="some streamed text")
    browser.find_element(By.ID, "stop").click()
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .timing")[-1].text
             == "stopped", what="the stopped mark")
    wait_for(lambda: _aborts(server) > before, timeout=10, what="the server to abort it")
    stats = httpx.get(f"{server}/v1/engine/stats", headers=_auth()).json()
    wait_for(lambda: httpx.get(f"{server}/v1/engine/stats", headers=_auth()).json()["running"]
             == 0, timeout=10, what="the batch to empty")
    assert stats["recent"]
    shot(browser, "stopped")


def test_dashboard_updates_while_requests_run(server, browser):
    from selenium.webdriver.common.by import By

    open_ui(browser, server)
    browser.find_element(By.ID, "tab-dash").click()
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#cards .card"),
             what="the dashboard cards")

    def rects() -> int:  # read in one script: the page re-renders every second
        return browser.execute_script("return document.querySelectorAll('#waterfall rect')"
                                      ".length")

    start = rects()
    done = threading.Event()

    def load() -> None:
        with httpx.Client(headers=_auth(), timeout=120) as c:
            for i in range(6):
                c.post(f"{server}/v1/completions", json={
                    "prompt": f"Count from {i} to {i + 40}:", "max_tokens": 40})
        done.set()

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    seen_running = wait_for(lambda: _card(browser, "running") not in ("", "0"),
                            what="a running request on the dashboard")
    shot(browser, "dashboard-busy")
    for t in threads:
        t.join()
    wait_for(lambda: rects() > start, what="new waterfall rows")
    wait_for(lambda: _card(browser, "running") == "0", what="the batch to empty")
    assert int(seen_running) >= 1
    assert _card(browser, "output tokens/s (10 s)") not in ("", "0.0")
    for label in ("TTFT ms p50/p90/p99", "ITL ms p50/p90/p99"):  # rounded, 3 of them
        assert re.fullmatch(r"(\d+(\.\d)? / ){2}\d+(\.\d)?", _card(browser, label)), label
    overflowing = browser.execute_script(
        "return [...document.querySelectorAll('#cards .card')]"
        "  .filter(c => c.scrollWidth > c.clientWidth || c.scrollHeight > c.clientHeight)"
        "  .map(c => c.textContent)")
    assert not overflowing, overflowing
    shot(browser, "dashboard")


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir):
    args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", block_size=4,
                      num_kv_blocks=256)
    with run_server(args, api_key=KEY) as (url, app):
        yield url, app


SLO = {"target_ttft_ms": 400.0, "target_itl_ms": 60.0, "good": 5, "missed_ttft": 1,
       "missed_itl": 0, "missed_both": 0, "goodput_per_s": 1.25}
CHARTS = ("tokens", "requests", "kv", "ttft", "itl")


def test_dashboard_draws_the_time_series(tiny_server, browser, monkeypatch):
    from selenium.webdriver.common.by import By

    url, app = tiny_server
    model = httpx.get(f"{url}/v1/models", headers=_auth()).json()["data"][0]["id"]
    with httpx.Client(headers=_auth(), timeout=60) as c:
        for i in range(4):  # spread over a few samples, so TTFT and ITL have points
            c.post(f"{url}/v1/completions", json={"prompt": f"count {i}", "max_tokens": 24,
                                                  "ignore_eos": True})
            time.sleep(0.6)
    open_ui(browser, url, model)
    browser.find_element(By.ID, "tab-dash").click()
    wait_for(lambda: all(c["points"] >= 3 for c in _charts(browser).values()
                         if c["id"] in ("tokens", "requests", "kv")),
             what="3 samples in the batch and KV charts")
    charts = wait_for(lambda: (c := _charts(browser)) and all(
        c[i]["points"] >= 1 for i in ("ttft", "itl")) and c, what="latency points")
    for name in CHARTS:
        chart = charts[name]
        assert chart["visible"] and chart["drawn"], chart
        assert chart["paths"] == [p for p in chart["paths"] if p], chart
        assert not chart["targets"], chart  # no slo yet: no target lines
    assert not charts["goodput"]["visible"]
    assert not charts["spec"]["visible"]  # no speculative decoding: no acceptance chart
    assert _fits(browser) == []
    _check_rounded(charts)

    metrics = app.state.kvserve.metrics
    plain = metrics.dashboard
    monkeypatch.setattr(metrics, "dashboard", lambda **kw: {**plain(**kw), "slo": SLO})
    charts = wait_for(lambda: (c := _charts(browser)) and c["goodput"]["visible"]
                      and c["goodput"]["points"] and c, what="the goodput chart")
    for name in ("ttft", "itl"):
        assert len(charts[name]["targets"]) == 1, charts[name]
        assert "target" in charts[name]["caption"]
    assert not charts["tokens"]["targets"]
    # the ITL target (60 ms) sits above the tiny model's gaps: inside the plot, not clipped
    y = float(charts["itl"]["targets"][0])
    assert 0 < y < browser.execute_script(
        "return document.querySelector('#chart-itl svg').clientHeight")
    wait_for(lambda: _card(browser, "goodput requests/s") == "1.3", what="the goodput card")
    _check_rounded(charts)
    assert _fits(browser) == []
    shot(browser, "dashboard-history")
    browser.set_window_size(560, 900)  # one chart a row: still inside the page
    try:
        wait_for(lambda: (c := _charts(browser))["tokens"]["width"] < 560
                 and all(c[name]["drawn"] for name in CHARTS), timeout=10,
                 what="charts redrawn at a narrow width")
        assert _fits(browser) == []
        shot(browser, "dashboard-history-narrow")
    finally:
        browser.set_window_size(1280, 900)

    without = {**SLO, "target_ttft_ms": None}
    monkeypatch.setattr(metrics, "dashboard", lambda **kw: {**plain(**kw), "slo": without})
    wait_for(lambda: not (c := _charts(browser))["ttft"]["targets"] and c["itl"]["targets"],
             what="only the ITL target line")
    monkeypatch.setattr(metrics, "dashboard", lambda **kw: {**plain(**kw), "slo": None})
    wait_for(lambda: not (c := _charts(browser))["goodput"]["visible"]
             and not c["itl"]["targets"], what="targets and goodput hidden again")

    # With speculation the acceptance chart shows, one line per draft position (the third
    # position, never verified here, has no line).
    recorder = app.state.kvserve.recorder
    monkeypatch.setattr(recorder, "_spec", lambda st: {
        "drafts": 5, "acceptance": 0.6, "acceptance_at": [0.75, 0.25, None]})
    chart = wait_for(lambda: (c := _charts(browser)["spec"])["visible"]
                     and len(re.findall("[ML]", c["paths"][0])) >= 2 and c,
                     what="the acceptance chart")
    assert chart["paths"][:3] == [p for p in chart["paths"][:3] if p] and not chart["paths"][3]
    assert "60.0" in chart["caption"] and "75.0" in chart["caption"], chart["caption"]
    _check_rounded({"spec": chart})


def test_dashboard_picks_one_replica_or_their_sum(tiny_server, browser):
    """A plain server lists itself only: no picker. Where /v1/engine/replicas lists several
    (Ray Serve's ingress), the dashboard offers their sum (the default, no parameter) and
    each replica, and asks for the one picked."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    url, app = tiny_server
    model = httpx.get(f"{url}/v1/models", headers=_auth()).json()["data"][0]["id"]
    open_ui(browser, url, model)
    browser.find_element(By.ID, "tab-dash").click()
    picker = browser.find_element(By.ID, "replica-pick")
    wait_for(lambda: len(Select(browser.find_element(By.ID, "replica")).options) == 2,
             what="the replica list")
    assert "hidden" in picker.get_attribute("class")

    async def two(_request):  # as the ingress answers with two live replicas
        return JSONResponse({"object": "list", "data": [{"id": "r-a"}, {"id": "r-b"}]})

    app.router.routes.insert(0, Route("/v1/engine/replicas", two))
    try:
        browser.find_element(By.ID, "tab-chat").click()
        browser.find_element(By.ID, "tab-dash").click()
        pick = wait_for(lambda: (sel := Select(browser.find_element(By.ID, "replica")))
                        and len(sel.options) == 3 and sel, what="three choices")
        assert [o.get_attribute("value") for o in pick.options] == ["", "r-a", "r-b"]
        assert pick.first_selected_option.text == "all 2 replicas (sum)"
        assert "hidden" not in picker.get_attribute("class")
        pick.select_by_value("r-b")
        asked = "return performance.getEntriesByType('resource').map((e) => e.name)"
        wait_for(lambda: any("/v1/engine/stats?replica=r-b" in u
                             for u in browser.execute_script(asked))
                 and any("/v1/engine/history?seconds=" in u and u.endswith("&replica=r-b")
                         for u in browser.execute_script(asked)),
                 what="the stats and history of replica r-b asked for")
    finally:
        app.router.routes.pop(0)


def _charts(driver) -> dict[str, dict]:
    """Each chart's state, read in one script (the page redraws them every second)."""
    return {c["id"]: c for c in driver.execute_script("""
        return [...document.querySelectorAll('#charts .chart')].map(f => {
          const paths = [...f.querySelectorAll('path.series')].map(p => p.getAttribute('d'));
          return {id: f.id.replace('chart-', ''), visible: f.offsetParent !== null,
                  // no series drawn yet: 0 (Math.min of nothing is Infinity, null in JSON)
                  paths, points: paths.length ? Math.min(...paths.map(
                    d => (d.match(/[ML]/g) || []).length)) : 0,
                  targets: [...f.querySelectorAll('line.target')].map(l => l.getAttribute('y1')),
                  caption: f.querySelector('figcaption').textContent,
                  values: [...f.querySelectorAll('figcaption b, text.ylabel')]
                    .map(e => e.textContent),
                  width: f.getBoundingClientRect().width,
                  // drawn for the width it has (the "now" label ends at its right edge)
                  drawn: paths.length > 0 && Math.abs(+f.querySelector('svg text:last-of-type')
                    .getAttribute('x') + 2 - f.querySelector('svg').clientWidth) < 1};
        })""")}


def _check_rounded(charts: dict[str, dict]) -> None:
    """Legend values and axis tops as the cards round them: whole from 100, one decimal
    below (an axis top is a round 1, 2, 2.5 or 5 times a power of ten)."""
    for chart in charts.values():
        if not chart["visible"]:
            continue
        for value in chart["values"]:
            assert re.fullmatch(r"–|\d+(\.\d)?|0\.0*(1|2|25|5)", value), (chart["id"], value)


def _fits(driver) -> list[str]:
    """Cards and charts whose content is wider than they are, and the page if it scrolls
    sideways."""
    return driver.execute_script(
        "const bad = [...document.querySelectorAll('#cards .card, #charts .chart')]"
        "  .filter(e => e.offsetParent !== null && e.scrollWidth > e.clientWidth)"
        "  .map(e => e.id || e.textContent);"
        "const page = document.documentElement;"
        "if (page.scrollWidth > page.clientWidth) bad.push('page');"
        "return bad;")


def _card(driver, label: str) -> str:
    """A dashboard card's value, read in one script (the page re-renders the cards every
    second, so element handles go stale)."""
    return driver.execute_script(
        "for (const c of document.querySelectorAll('#cards .card'))"
        "  if (c.querySelector('.label').textContent === arguments[0])"
        "    return c.querySelector('.value').textContent;"
        "return '';", label)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def _aborts(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    for line in text.splitlines():
        if line.startswith("kvserve:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
