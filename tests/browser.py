"""Headless Chromium for the playground's browser test: Debian's `chromium` and `chromedriver`
(test.sh installs them when missing), driven through Selenium with no network of its own."""
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
