"""The reports in a real browser (headless Chromium): no console errors, no script from trace
content runs, the key sections are there, the images decode, our own script runs under the CSP.
Screenshots land in tests/reports/artifacts/ (or $QF_REPORT_ARTIFACTS) for a person to look at.
Without Chromium these tests FAIL: the project's test set-up installs it."""

from __future__ import annotations

import base64

import pytest
from report_inputs import ARTIFACTS, HOSTILE_NAMES, HOSTILE_TEXT

pytestmark = pytest.mark.browser

SECTIONS = ("verdict", "chain", "plots", "plot-logits", "plot-heatmap", "recommendations",
            "table-outliers", "table-damage", "table-health", "table-environment")


def _load(driver, path):
    driver.get(path.resolve().as_uri())
    driver.execute_script("return document.readyState")


def _console_errors(driver) -> list[str]:
    try:
        logs = driver.get_log("browser")
    except Exception:  # noqa: BLE001  some drivers lack it; the collector below still runs
        logs = []
    errs = [e["message"] for e in logs if e.get("level") == "SEVERE"]
    return errs + list(driver.execute_script("return window.__qfErrors || []"))


def _screenshot(driver, name: str) -> str:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = driver.execute_cdp_cmd("Page.captureScreenshot",
                                  {"format": "png", "captureBeyondViewport": True})
    out = ARTIFACTS / f"report-{name}.png"
    out.write_bytes(base64.b64decode(shot["data"]))
    print(f"screenshot: {out}")
    return str(out)


def test_reports_render_cleanly(browser, reports, capsys):
    for name, path in reports.items():
        if name == "hostile":
            continue
        _load(browser, path)
        errs = _console_errors(browser)
        assert errs == [], f"{name}: console errors {errs}"
        for sid in SECTIONS:
            assert browser.find_elements("id", sid), f"{name}: section #{sid} missing"
        images = browser.execute_script(
            "return Array.from(document.images).map(i => [i.complete, i.naturalWidth]);")
        assert images and all(ok and w > 100 for ok, w in images), f"{name}: {images}"
        # our one inline script is allowed by the CSP hash and ran: the toggles are shown
        assert browser.find_element("id", "qf-toggles").is_displayed()
        browser.find_element("id", "qf-close-all").click()
        assert not browser.execute_script("return document.getElementById('chain').open")
        browser.find_element("id", "qf-open-all").click()
        assert browser.execute_script("return document.getElementById('chain').open")
        _screenshot(browser, name)
    with capsys.disabled():
        print(f"\nreport screenshots in {ARTIFACTS}")


def test_hostile_trace_content_never_runs(browser, reports):
    _load(browser, reports["hostile"])
    assert browser.execute_script("return typeof window.__pwned") == "undefined"
    assert _console_errors(browser) == []
    body = browser.find_element("tag name", "body").text
    source = reports["hostile"].read_text()
    shown = 0
    for name in HOSTILE_NAMES.values():
        escaped = name.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        if escaped.replace('"', "&#34;") in source:  # the name is in the page's text somewhere
            assert name in body, f"{name!r} not shown as text"
            shown += 1
    assert shown >= 1
    assert '<img src=x onerror="window.__pwned=2">' in body  # the producer's name
    assert "<b>evil-host</b>" in body
    assert "<script>window.__pwned=4</script>" in body
    assert HOSTILE_TEXT.split(" & ")[1] in body  # "<b>bold</b>" literally, not bold
    assert browser.execute_script("return document.querySelectorAll('main script, main img:not("
                                  "[src^=\"data:image/png\"]), main svg').length") == 0
    _screenshot(browser, "hostile")


def test_page_works_without_javascript(reports, tmp_path):
    """The sections are <details open>: everything is visible with scripts off (static check)."""
    html = reports["hostile"].read_text()
    assert html.count('<details class="qf-section"') == html.count(
        '<details class="qf-section" id=') and ' open>' in html
    assert 'id="qf-toggles" hidden' in html  # buttons only appear when the script runs
