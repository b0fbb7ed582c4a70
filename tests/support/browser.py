"""A headless Chromium for the view's browser tests, through Selenium WebDriver and Debian's chromium-driver.

Selenium rather than Playwright: it is a small pure-Python wheel that drives the distribution's own
`chromium` and `chromedriver` (`apt-get install chromium chromium-driver`), where Playwright ships a
50 MB wheel with its own Node driver and expects to download its own browser build.

Missing pieces skip the tests with how to install them, except under CI (`CI=true`), where they fail: a CI
run that silently skipped the browser would claim what it did not check.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest

CHROMIUM = os.environ.get("PIPEC_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("PIPEC_CHROMEDRIVER", "/usr/bin/chromedriver")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1300,1000",
)
INSTALL = "apt-get install -y chromium chromium-driver && pip install -e '.[view-test]'"


def _missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium package is not installed"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            return f"{path} is missing"
    return None


def launch():
    """A headless Chromium (a fresh profile, no network services), or skip/fail as the module docstring says."""
    why = _missing()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"browser tests need Chromium and Selenium under CI: {why} (install: {INSTALL})")
        pytest.skip(f"{why}; install with: {INSTALL}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="pipec-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={profile}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_script_timeout(60)
    driver.pipec_profile = profile
    return driver


def close(driver) -> None:
    driver.quit()
    shutil.rmtree(driver.pipec_profile, ignore_errors=True)


def wait_for(driver, script: str, timeout: float = 20.0):
    """Poll a JS expression until it is truthy; its value."""
    end = time.monotonic() + timeout
    while True:
        value = driver.execute_script("return " + script)
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for: {script}")
        time.sleep(0.05)


def console_errors(driver) -> list[dict]:
    """The page's console errors (and failed loads) since the last call."""
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def hover(driver, x: float, y: float) -> None:
    """Move the real mouse to canvas point (x, y) of the view."""
    from selenium.webdriver.common.action_chains import ActionChains

    canvas = driver.find_element("css selector", ".pv-wrap canvas")
    w, h = canvas.size["width"], canvas.size["height"]
    driver.execute_script("arguments[0].scrollIntoView({block: 'nearest'})", canvas)
    ActionChains(driver).move_to_element_with_offset(canvas, int(x - w / 2), int(y - h / 2)).perform()


def tooltip(driver) -> str:
    return driver.execute_script("return document.getElementById('pipec-tip').innerText")


def click(driver, x: float, y: float) -> None:
    """Click the real mouse at canvas point (x, y) of the view."""
    from selenium.webdriver.common.action_chains import ActionChains

    canvas = driver.find_element("css selector", ".pv-wrap canvas")
    w, h = canvas.size["width"], canvas.size["height"]
    ActionChains(driver).move_to_element_with_offset(canvas, int(x - w / 2), int(y - h / 2)).click().perform()
