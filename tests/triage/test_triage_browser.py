"""The fleet page in headless Chromium: no console error or CSP violation, nothing from trace
content runs, the groups sort by count and by first time, and the representative's report
link opens that report."""

from __future__ import annotations

from pathlib import Path

import fleet_synth
import pytest
from click.testing import CliRunner

from qforensics.cli import main

pytestmark = pytest.mark.browser

EVIL_MODEL = '<img src=x onerror="window.__pwned=1">'
EVIL_HOST = "<script>window.__pwned=2</script>"
EVIL_FILE = "<b onclick=alert(1)>bad.h5"


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    d = tmp_path_factory.mktemp("fleet-page")
    t = 1.79e9
    specs = [
        # two incidents of one kind, later; one of another kind, first
        fleet_synth.Spec(str(d / "a0.h5"), incident="gap", layer=1, t0=t + 500, steps=2,
                         shape="qwen2.5-0.5b-4l", seed=1),
        fleet_synth.Spec(str(d / "a1.h5"), incident="gap", layer=1, t0=t + 600, steps=2,
                         shape="qwen2.5-0.5b-4l", seed=2),
        fleet_synth.Spec(str(d / "evil.h5"), incident="weight_nan", layer=2, t0=t, steps=2,
                         shape="qwen2.5-0.5b-4l", model=EVIL_MODEL, host=EVIL_HOST, seed=3),
        fleet_synth.Spec(str(d / "ok.h5"), steps=2, shape="qwen2.5-0.5b-4l", seed=4),
    ]
    for s in specs:
        fleet_synth.write_trace(s)
    (d / EVIL_FILE).write_bytes(b"\x89HDF\r\n\x1a\n" + b"\x00" * 64)
    out = d / "out"
    res = CliRunner().invoke(main, ["triage", str(d), "-o", str(out), "--workers", "1",
                                    "--quiet"])
    assert res.exit_code == 1, res.output
    return out / "fleet.html", specs


def _order(browser) -> list[int]:
    return [int(x) for x in browser.execute_script(
        "return Array.from(document.querySelectorAll('#groups-body tr'))"
        ".map(function(r){return r.dataset.group;});")]


def _producers(browser) -> list[str]:
    return browser.execute_script(
        "return Array.from(document.querySelectorAll('#groups-body tr'))"
        ".map(function(r){return r.cells[5].querySelector('code').textContent;});")


def test_fleet_page_renders_sorts_and_links(browser, page):
    html, _ = page
    browser.get(html.resolve().as_uri())
    errs = _reports_errors(browser)
    assert errs == [], errs
    assert browser.execute_script("return window.__pwned") is None
    # every hostile string is shown as text
    body = browser.find_element("tag name", "body").text
    assert EVIL_MODEL in body and EVIL_FILE in body
    gap = "model.layers.1.mlp.down_proj"
    nan = "model.layers.2.self_attn.o_proj"
    assert _producers(browser) == [gap, nan]  # by count: 2 incidents, then 1
    assert browser.find_element("id", "qf-sort").is_displayed()  # our script ran under the CSP
    browser.find_element("id", "sort-first").click()
    assert _producers(browser) == [nan, gap]  # the weight NaN came first (t0)
    browser.find_element("id", "sort-count").click()
    assert _producers(browser) == [gap, nan]
    assert browser.find_element("id", "n-unreadable").text == "1"
    links = browser.find_elements("css selector", "a.report-link")
    assert len(links) == 2
    href = links[0].get_attribute("href")
    assert Path(href.removeprefix("file://")).is_file()
    links[0].click()
    assert browser.find_elements("id", "verdict")
    assert _reports_errors(browser) == []
    assert browser.execute_script("return window.__pwned") is None


def _reports_errors(browser) -> list[str]:
    try:
        logs = browser.get_log("browser")
    except Exception:  # noqa: BLE001
        logs = []
    errs = [e["message"] for e in logs if e.get("level") == "SEVERE"]
    return errs + list(browser.execute_script("return window.__qfErrors || []"))
