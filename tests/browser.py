"""Headless Chromium (Debian's `chromium` + `chromium-driver`) driven by Selenium, for the dashboard's tests.

Selenium is pointed at the system's binaries: its own driver and browser downloads cannot reach
the internet here (Selenium Manager is never asked, since both paths are given).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "artifacts"  # kept by CI beside the run (.gitignore'd)


def missing() -> str | None:
    """Why a browser cannot run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e .[test])"
    if not shutil.which("chromium"):
        return "chromium is not installed (Debian package chromium; scripts/install.sh adds it)"
    if not shutil.which("chromedriver"):
        return "chromedriver is not installed (Debian package chromium-driver; scripts/install.sh adds it)"
    return None


def chrome(width: int = 1400, height: int = 1100):
    """A headless Chromium whose console messages can be read (`console(driver)`)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--no-first-run", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")), options=options)
    driver.set_page_load_timeout(60)
    return driver


def console_errors(driver) -> list[str]:
    """Chromium's console messages of level SEVERE since the last call (script errors, failed loads, CSP)."""
    return [f"{e.get('source')}: {e.get('message')}" for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def wait_until(predicate, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception as exc:  # the page is between two renders
            last, value = exc, None
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"{what} (after {timeout:.1f} s; last error: {last!r})")


def screenshot(driver, tmp_dir: Path, name: str) -> Path:
    """The page as PNG under the test's tmp dir and under artifacts/ (CI keeps it); the latter's path."""
    shot = tmp_dir / name
    driver.save_screenshot(str(shot))
    ARTIFACTS.mkdir(exist_ok=True)
    kept = ARTIFACTS / name
    shutil.copy(shot, kept)
    print(f"dashboard screenshot: {kept} (and {shot})")
    return kept
