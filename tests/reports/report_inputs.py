"""What the report tests share beyond fixtures: the hostile names and text planted in a trace,
and where screenshots go. A module of its own (not conftest.py) so that a test imports it by a
name no other test folder uses: `from conftest import ...` resolves to whichever folder's
conftest was imported last when several folders run together."""

from __future__ import annotations

import os
from pathlib import Path

from synth import bad_module_index

HERE = Path(__file__).resolve().parent
ARTIFACTS = Path(os.environ.get("QF_REPORT_ARTIFACTS", HERE / "artifacts"))

HOSTILE_NAMES = {
    0: "<script>window.__pwned=1</script>",
    bad_module_index(): '<img src=x onerror="window.__pwned=2">',
    1: "a$x^2$b\\",
    3: '"><svg onload="window.__pwned=3">',
    5: "$\\frac{a}{b}$",  # TeX: drawn as these characters, never as math
}
HOSTILE_TEXT = "<script>window.__pwned=4</script> & <b>bold</b>"
