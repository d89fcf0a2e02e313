"""A headless Chromium driven by selenium, to read a page as its reader sees it: the server's page
(scripts/screenshot_page.py takes its picture; the tests click through it) and the book's pages.
`make browser` installs Debian's chromium and chromium-driver; selenium comes with the tests'
requirements."""

from __future__ import annotations

import shutil
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync")


def missing() -> str | None:
    """Why no headless browser can run here, or None."""
    for exe in ("chromium", "chromedriver"):
        if shutil.which(exe) is None:
            return f"{exe} is not installed"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (requirements-test.txt)"
    return None


def chromium(profile: Path, window: str = "1400,1000", flags=()):
    """A fresh headless Chromium with its own profile folder and window size (`width,height`), and
    any further command-line flags; the caller quits it."""
    from selenium import webdriver
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in (*FLAGS, f"--window-size={window}", f"--user-data-dir={profile}", *flags):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))
