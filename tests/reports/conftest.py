"""Fixtures for the report tests: sample traces (committed copies, else synthetic ones), the
reports written from them once per session, a hostile-names trace, and headless Chromium."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from synth import bad_module_index, write_synthetic_trace

ROOT = HERE.parents[1]
SAMPLES = ROOT / "sample_traces"
ARTIFACTS = Path(os.environ.get("QF_REPORT_ARTIFACTS", HERE / "artifacts"))
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

HOSTILE_NAMES = {
    0: "<script>window.__pwned=1</script>",
    bad_module_index(): '<img src=x onerror="window.__pwned=2">',
    1: "a$x^2$b\\",
    3: '"><svg onload="window.__pwned=3">',
}
HOSTILE_TEXT = "<script>window.__pwned=4</script> & <b>bold</b>"


def sample_traces() -> list[Path]:
    return sorted(SAMPLES.glob("*.h5"))


@pytest.fixture(scope="session")
def traces(tmp_path_factory) -> dict[str, Path]:
    """name -> trace: the committed sample traces when present, else synthetic ones."""
    found = {p.stem: p for p in sample_traces()}
    if found:
        return found
    d = tmp_path_factory.mktemp("synthetic")
    return {"synthetic-fail": write_synthetic_trace(d / "synthetic-fail.h5"),
            "synthetic-ok": write_synthetic_trace(d / "synthetic-ok.h5", fail=False, seed=1)}


@pytest.fixture(scope="session")
def failing_trace(traces) -> Path:
    return traces.get("fp8-e4m3-nosat-act") or traces["synthetic-fail"]


@pytest.fixture(scope="session")
def hostile_trace(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hostile")
    return write_synthetic_trace(
        d / "hostile.h5", names=HOSTILE_NAMES, text=HOSTILE_TEXT,
        environment={"host": "<b>evil-host</b>",
                     "scenario": "</style><script>window.__pwned=5</script>"})


@pytest.fixture(scope="session")
def reports(traces, hostile_trace, tmp_path_factory) -> dict[str, Path]:
    """name -> HTML report, written once per session (the hostile one included)."""
    from qforensics.reports import write_report

    d = tmp_path_factory.mktemp("reports")
    out = {}
    for name, path in {**traces, "hostile": hostile_trace}.items():
        out[name] = write_report(path, d / f"{name}.html").path
    return out


def _require_chromium() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    if missing:
        pytest.fail(f"headless browser tests need {', '.join(missing)}: install them with "
                    "`apt-get install -y chromium chromium-driver` (the project's test set-up "
                    "does this)", pytrace=False)
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.fail("browser tests need selenium: pip install 'qforensics[test]'", pytrace=False)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium with a fresh profile; collects console messages and page errors."""
    _require_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    profile = tmp_path_factory.mktemp("chromium-profile")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu",
                "--disable-background-networking", "--disable-dev-shm-usage",
                f"--user-data-dir={profile}", "--window-size=1200,1000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    # Runs before any page script; CDP-injected code is not subject to the page's CSP.
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": (
        "window.__qfErrors=[];"
        "window.addEventListener('error',function(e){window.__qfErrors.push(String(e.message||"
        "(e.target&&e.target.outerHTML)||e));},true);"
        "document.addEventListener('securitypolicyviolation',function(e){"
        "window.__qfErrors.push('CSP '+e.violatedDirective+' '+e.blockedURI);});")})
    try:
        yield driver
    finally:
        driver.quit()
