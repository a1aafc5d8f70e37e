"""The web UI in a real headless browser (Debian's chromium driven by Selenium), against the
server on the default model with an API key: a streamed chat answer, the stop button
aborting a generation, and the dashboard updating while requests run. Screenshots go to
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


def open_ui(driver, url: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(url + "/")
    key = driver.find_element(By.ID, "apikey")
    key.clear()
    key.send_keys(KEY)
    driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", key)
    wait_for(lambda: driver.find_element(By.ID, "model").text == "SmolLM2-135M-Instruct",
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
