"""Headless Chromium for the playground's browser test and screenshot: Debian's `chromium` and
`chromedriver` (test.sh installs them when missing), driven through Selenium with no network of its own."""
from __future__ import annotations

import shutil
import tempfile

import pytest

# Chromium's own background connections are refused on a closed network (and slow its start).
QUIET_FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-dev-shm-usage",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1400,900",
)


def chromium():
    """A started headless browser (a Selenium WebDriver); skips where Chromium is not installed."""
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (browser and driver):
        pytest.skip("needs Debian's chromium and chromium-driver (./test.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in QUIET_FLAGS + (f"--user-data-dir={tempfile.mkdtemp(prefix='specdec-chromium-')}",):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def ask_playground(browser, url: str, prompt: str, plan: str, max_tokens: int, timeout_s: float = 900) -> None:
    """Opens the playground at `url` once it names its model, asks `prompt` with the page's
    speculation choice `plan` (adaptive, chain-4, off, ...) and token limit, and waits for the
    whole answer."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser.get(url)
    WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "model").text.startswith("serving"))
    browser.execute_script(
        "document.getElementById('prompt').value = arguments[0]; document.getElementById('max-tokens').value = arguments[1]",
        prompt, str(max_tokens),
    )
    Select(browser.find_element(By.ID, "plan")).select_by_value(plan)
    browser.find_element(By.ID, "run").click()
    WebDriverWait(browser, timeout_s).until(lambda b: b.find_element(By.ID, "answer").get_attribute("data-done") == "true")
