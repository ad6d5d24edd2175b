"""Every request that went bad over a long serving run, and whether it was possibly reached from
another or went bad on its own (and then at the same position or length as others).

The traces are vLLM-shaped runs written through the real writer (tests/analyze/engine_runs.py);
every expectation is worked out from how the run was built: which request is scheduled at
which step, at which position its row turns NaN and at which module."""

from __future__ import annotations

import json
import os
import sys

import pytest

from qforensics import open_trace
from qforensics.analyze import analyze_trace
from qforensics.reports.report import render_report

sys.path.insert(0, os.path.dirname(__file__))
from engine_runs import N_MOD, Req, token, write_run  # noqa: E402

LINE = "requests went bad on their own at position"
MIB = 1 << 20


def _by(f):
    return {b.request_id: b for b in f.engine.went_bad}


def test_same_position_far_apart_a_different_position_and_a_spread(tmp_path):
    # R0 and R1 turn NaN at position 64 (layer 3), 200 steps apart, each alone in its forward
    # with the healthy H; R2 at position 40; R3 while R2 (still bad: its KV cache) decodes in
    # the same forward, at a later layer than R2's rows go NaN there
    r0, r1, r2, r3 = Req("R0", 0, 8, 60), Req("R1", 200, 8, 70), Req("R2", 300, 16, 60), \
        Req("R3", 330, 4, 30)
    h = Req("H", 0, 5, 420)
    s0, s1, s2, s3 = r0.step_at(64), r1.step_at(64), r2.step_at(40), 340
    p3 = r3.prompt + s3 - (r3.start + 1)
    nan = {(s0, "R0"): {64: 3}, (s1, "R1"): {64: 3}, (s2, "R2"): {40: 3},
           (s3, "R3"): {p3: 5}}
    assert s1 - s0 > 64 and r0.start + r0.steps < r1.start  # far apart, R0 gone by then
    assert r2.start + r2.steps > s3  # R2 still decodes (bad) when R3 goes bad
    p = tmp_path / "t.h5"
    write_run(p, [r0, r1, r2, r3, h], 430, nan)  # rows stay bad from layer 0 on
    f = analyze_trace(p)
    assert f.status == "FAILED" and f.first_nonfinite.step == s0
    eng = f.engine
    bad = _by(f)
    assert list(bad) == ["R0", "R1", "R2", "R3"]  # first bad step first
    assert [bad[r].step for r in bad] == [s0, s1, s2, s3]
    assert [bad[r].position for r in bad] == [64, 64, 40, p3]
    assert [bad[r].length for r in bad] == [65, 65, 41, p3 + 1]
    assert [bad[r].prompt_tokens for r in bad] == [8, 8, 16, 4]
    assert {bad[r].phase for r in bad} == {"decode"}
    assert [bad[r].first_module for r in bad] == [f"model.layers.{m}.proj" for m in (3, 3, 3, 5)]
    assert [bad[r].kind for r in bad] == ["independent_same_position"] * 2 + [
        "independent", "possibly_spread"]
    assert bad["R0"].same_position_as == ["R1"] and bad["R1"].same_position_as == ["R0"]
    assert bad["R3"].spread_from == ["R2"] and bad["R2"].spread_from == []
    assert bad["R0"].token == token(0, 64) and bad["R1"].token == token(1, 64)
    assert [h.request_id for h in eng.reached] == ["R3"]  # R1 is no longer called "spread"
    assert [(h.request_id, h.step) for h in eng.first] == [("R0", s0)]
    assert eng.clean == ["H"] and eng.unattributed_steps == 0
    [spot] = eng.same_spots
    assert (spot.by, spot.value, spot.requests, spot.steps) == ("position", 64, ["R0", "R1"],
                                                                [s0, s1])
    text = "\n".join(f.notes)
    assert (f"2 {LINE} 64 (R0, R1; steps {s0}, {s1}): points to a position- or length-"
            "dependent cause (a rotary table, a kernel that switches at a size, a KV block "
            "boundary); with different input tokens there") in text
    assert f"possibly spread to other requests: R3 at step {s3} (from R2 in the same forward)" \
        in text
    assert not any("spread" in n and "R1" in n for n in f.notes)
    assert "4 requests went bad over the run: 3 on their own, 1 possibly spread" in f.notes
    assert (f"request R2: went bad at step {s2} (decode) at position 40 (length 41, prompt 16 "
            "tokens), first in model.layers.3.proj: on its own (no other request held NaN/Inf "
            "in that forward)") in text
    js = json.loads(json.dumps(f.to_dict()))["engine"]
    assert [b["kind"] for b in js["went_bad"]] == [bad[r].kind for r in bad]
    assert js["went_bad"][3]["spread_from"] == ["R2"]
    assert js["same_spots"][0]["value"] == 64 and js["same_spots"][0]["by"] == "position"
    assert js["same_spots"][0]["requests"] == ["R0", "R1"]


def test_the_earliest_op_of_the_forward_decides(tmp_path):
    # X goes bad first and stays bad from layer 1's output on; Z goes bad in a forward with X
    # but already at layer 0's output (before X's rows are NaN there): on its own; Y at layer 4
    # while both are bad: possibly spread from both. P's prefill turns NaN at position 5
    # (layer 2), then layer 3 smears it over positions 0, 6 and 7: its first bad position is 5.
    # Q1 and Q2 go bad at the same op of one forward, both at position 13; R and S at
    # different positions of 12-token prefills: the same length
    x, z, y = Req("X", 0, 20, 30), Req("Z", 2, 6, 28), Req("Y", 5, 3, 25)
    pp = Req("P", 40, 8, 5)
    q1, q2 = Req("Q1", 50, 4, 20), Req("Q2", 52, 6, 20)
    r, s = Req("R", 80, 12, 2), Req("S", 85, 12, 2)
    pos = {n: q.prompt + st - q.start - 1 for n, q, st in
           (("X", x, 10), ("Z", z, 20), ("Y", y, 25), ("Q1", q1, 60), ("Q2", q2, 60))}
    assert pos["Q1"] == pos["Q2"] == 13 and len(set(pos.values())) == 4
    nan = {(10, "X"): {pos["X"]: 2}, (20, "Z"): {pos["Z"]: 0}, (25, "Y"): {pos["Y"]: 4},
           (40, "P"): {5: 2, 0: 3, 6: 3, 7: 3}, (60, "Q1"): {13: 2}, (60, "Q2"): {13: 2},
           (80, "R"): {2: 1}, (85, "S"): {7: 1}}
    p = tmp_path / "t.h5"
    write_run(p, [x, z, y, pp, q1, q2, r, s], 90, nan, stay_bad_from=1)
    bad = _by(analyze_trace(p))
    assert list(bad) == ["X", "Z", "Y", "P", "Q1", "Q2", "R", "S"]
    assert bad["X"].kind == "independent" and bad["Z"].kind == "independent"
    assert bad["Z"].first_module == "model.layers.0.proj"
    assert bad["Y"].kind == "possibly_spread" and bad["Y"].spread_from == ["X", "Z"]
    assert (bad["P"].position, bad["P"].length, bad["P"].phase, bad["P"].rows) == (
        5, 8, "prefill", 4)
    assert bad["P"].kind == "independent"
    for q in ("Q1", "Q2"):
        assert bad[q].kind == "independent_same_position" and bad[q].position == 13
    assert bad["Q1"].together_with == ["Q2"] and bad["Q2"].together_with == ["Q1"]
    assert (bad["R"].position, bad["S"].position) == (2, 7)
    assert bad["R"].kind == bad["S"].kind == "independent_same_length"
    assert bad["R"].length == bad["S"].length == 12
    f = analyze_trace(p)
    assert bad["Z"].line.endswith(": on its own (at an earlier op of that forward than X)")
    assert "8 requests went bad over the run: 7 on their own, 1 possibly spread" in f.notes
    spots = [(sp.by, sp.value, sp.requests) for sp in f.engine.same_spots]
    assert spots == [("position", 13, ["Q1", "Q2"]), ("length", 12, ["R", "S"])]
    assert any(n.startswith("2 requests went bad on their own at length 12 (R, S; steps 80, "
                            "85)") for n in f.notes)
    # the writer's own record of each first hit (/engine/hits), from the same construction:
    # (step, position, first module, others bad at an earlier op, others first bad at it)
    want = {"X": (10, pos["X"], 2, 0, 0), "Z": (20, pos["Z"], 0, 0, 0),
            "Y": (25, pos["Y"], 4, 2, 0), "P": (40, 5, 2, 0, 0), "Q1": (60, 13, 2, 0, 1),
            "Q2": (60, 13, 2, 0, 1), "R": (80, 2, 1, 0, 0), "S": (85, 7, 1, 0, 0)}
    names = [q.name for q in (x, z, y, pp, q1, q2, r, s)]
    with open_trace(p) as t:
        h = t.engine_table("hits")
    got = {names[int(q)]: (int(st), int(po), int(m), int(e), int(so)) for q, st, po, m, e, so
           in zip(h["request"], h["step"], h["position"], h["module_id"], h["earlier"],
                  h["same_op"])}
    assert got == want and len(h) == len(want)
    assert h["token"].tolist() == [token(names.index(n), want[n][1]) for n in got]


def test_a_healthy_long_run_names_no_bad_request(tmp_path):
    reqs = [Req(f"H{i}", 37 * i, 6 + i, 380 - 37 * i) for i in range(6)]
    p = tmp_path / "t.h5"
    write_run(p, reqs, 400)
    f = analyze_trace(p)
    assert f.status == "PASSED" and f.exit_code == 0
    eng = f.engine
    assert eng.went_bad == [] and eng.same_spots == [] and eng.reached == []
    assert eng.unattributed_steps == 0 and eng.n_requests == 6
    assert not any("went bad" in n or "spread" in n for n in f.notes)


def test_requests_after_the_budget_are_found_in_the_pinned_windows(tmp_path):
    # the byte budget stops full detail early; A and B go bad on their own at position 64,
    # 200 steps apart, long after it; C at position 30
    a, b, c = Req("A", 400, 8, 58), Req("B", 600, 8, 58), Req("C", 800, 16, 20)
    hs = [Req(f"H{i}", 0, 5, 1000) for i in range(16)]
    nan = {(a.step_at(64), "A"): {64: 3}, (b.step_at(64), "B"): {64: 3},
           (c.step_at(30), "C"): {30: 2}}
    p = tmp_path / "t.h5"
    write_run(p, [a, b, c, *hs], 1000, nan, max_bytes=9 * MIB)
    f = analyze_trace(p)
    assert 0 < f.coverage["stopped_at"] < a.step_at(64)
    bad = _by(f)
    assert list(bad) == ["A", "B", "C"]
    assert [bad[r].step for r in bad] == [a.step_at(64), b.step_at(64), c.step_at(30)]
    assert [bad[r].kind for r in bad] == ["independent_same_position"] * 2 + ["independent"]
    assert [(sp.value, sp.requests) for sp in f.engine.same_spots] == [(64, ["A", "B"])]
    assert f.engine.unattributed_steps == 0  # every bad step was pinned with its rows


def test_requests_past_every_pinned_window_are_named_from_the_writers_hits(tmp_path):
    # steps as wide as a real model's fill the budget at once; A goes bad at position 20 and
    # stays bad for 280 steps, whose windows take what room is left, so B's and C's first bad
    # steps (alone but for healthy requests) keep no full detail: the writer's /engine/hits
    # still says where each went bad, through which module, on which input token
    a, b, c = Req("A", 300, 8, 300), Req("B", 620, 8, 40), Req("C", 800, 16, 20)
    hs = [Req(f"H{i}", 0, 5, 1000) for i in range(16)]
    nan = {(a.step_at(20), "A"): {20: 3}, (b.step_at(30), "B"): {30: 2},
           (c.step_at(25), "C"): {25: 4}}
    p = tmp_path / "t.h5"
    write_run(p, [a, b, c, *hs], 1000, nan, max_bytes=9 * MIB, wide=1 << 16)
    with open_trace(p) as t:
        pins = dict(zip(t.pinned_table["step"].tolist(), t.pinned_table["kept"].tolist()))
    assert pins[a.step_at(20)] == 1 and pins[b.step_at(30)] == pins[c.step_at(25)] == 0
    f = analyze_trace(p)
    got = [(x.request_id, x.step, x.position, x.token, x.first_module, x.phase, x.kind)
           for x in f.engine.went_bad]
    assert got == [("A", a.step_at(20), 20, token(0, 20), "model.layers.3.proj", "decode",
                    "independent"),
                   ("B", b.step_at(30), 30, token(1, 30), "model.layers.2.proj", "decode",
                    "independent"),
                   ("C", c.step_at(25), 25, token(2, 25), "model.layers.4.proj", "decode",
                    "independent")]
    assert "H0" in f.engine.clean and "B" not in f.engine.clean
    # A's later bad steps kept no token rows, but the writer scanned each of them as it came
    # (a request stays bad from its first bad step to its last): every one is accounted for,
    # so the healthy requests are said never hit
    bad_steps = set()
    for r, pos in ((a, 20), (b, 30), (c, 25)):
        bad_steps |= set(range(r.step_at(pos), r.start + r.steps + 1))
    with open_trace(p) as t:
        assert t.hits_checked == {"bad_steps": len(bad_steps), "scanned": len(bad_steps),
                                  "dropped": 0}
    assert f.engine.unattributed_steps == 0
    assert any(n.startswith("requests never hit: ") and "H0" in n for n in f.notes)


def test_a_request_that_goes_bad_first_in_its_attention_after_others_reads_kv_cache(
        tmp_path, monkeypatch):
    # module 4 is an attention's o_proj (its input: the attention's output). C0 goes bad there
    # first in the run: nothing before it, so on its own. A goes bad at layer 1 on its own;
    # B, later, alone but for the healthy H, first at the o_proj: possibly through the KV
    # cache that C0 and A used before it
    import engine_runs

    mods = [dict(m) for m in engine_runs.MODULES]
    mods[4]["name"] = "model.layers.2.self_attn.o_proj"
    monkeypatch.setattr(engine_runs, "MODULES", mods)
    c0, a, b = Req("C0", 0, 8, 20), Req("A", 40, 8, 20), Req("B", 80, 8, 20)
    h = Req("H", 0, 5, 110)
    nan = {(c0.step_at(10), "C0"): {10: 4}, (a.step_at(12), "A"): {12: 1},
           (b.step_at(14), "B"): {14: 4}}
    p = tmp_path / "t.h5"
    write_run(p, [c0, a, b, h], 110, nan)
    f = analyze_trace(p)
    bad = _by(f)
    assert [(r, bad[r].kind) for r in bad] == [
        ("C0", "independent"), ("A", "independent"), ("B", "possibly_via_kv_cache")]
    assert bad["B"].kv_from == ["A", "C0"] and bad["B"].position == 14
    assert "possibly through the KV cache" in bad["B"].line
    assert "3 requests went bad over the run: 2 on their own, 0 possibly spread, 1 possibly " \
        "through the KV cache" in f.notes


def test_bad_steps_without_token_rows_are_counted_not_guessed(tmp_path):
    # A goes bad at position 64 and stays bad 5 more steps; 3 of its bad steps lost their
    # /engine rows: the requests they hit are unknown, and said so
    a, h = Req("A", 0, 8, 62), Req("H", 0, 4, 80)
    s0 = a.step_at(64)
    lost = frozenset({s0 + 1, s0 + 3, s0 + 4})
    p = tmp_path / "t.h5"
    write_run(p, [a, h], 80, {(s0, "A"): {64: 3}}, rows_lost=lost)
    f = analyze_trace(p)
    eng = f.engine
    assert [(b.request_id, b.step, b.position) for b in eng.went_bad] == [("A", s0, 64)]
    assert eng.unattributed_steps == 3 and eng.followed_steps == 6 - 3
    with open_trace(p) as t:  # the writer had no rows for them either: it could not scan them
        assert t.hits_checked == {"bad_steps": 6, "scanned": 3, "dropped": 0}
    assert ("3 non-finite step(s) have no recorded token rows: the requests they hit are "
            "unknown") in f.notes


@pytest.mark.parametrize("name", ["<b>R0</b>", "R0&x"])
def test_the_report_lists_the_requests_escaped(tmp_path, name):
    r0, r1 = Req(name, 0, 8, 60), Req("R1", 100, 8, 60)
    nan = {(r0.step_at(64), name): {64: 3}, (r1.step_at(64), "R1"): {64: 3}}
    p = tmp_path / "t.h5"
    write_run(p, [r0, r1], 170, nan)
    html, f = render_report(p)
    i = html.index('id="table-requests"')
    section = html[i:html.index("</details>", i)]
    assert "Requests that went bad" in section and name not in html
    esc = name.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    assert f"<td><code>{esc}</code></td><td class=\"r\">{r0.step_at(64)}</td>" in section
    assert "2 requests went bad on their own at position 64" in section
    assert section.count("independent same position") == 2
    assert f.engine.went_bad[0].request_id == name and N_MOD > 3


def test_requests_reaching_one_bad_position_in_turn_are_not_spread(tmp_path):
    # the rotary-table case (a NaN row of the cos/sin cache at position 20): A (17-token
    # prompt) goes bad when it computes position 20; B (5-token prompt), served beside A,
    # goes bad when it reaches position 20 itself, 12 steps later, in a forward where A is
    # still bad (from layer 0 on, an earlier op than B's): each went bad on its own at the
    # same position, which names the position, not a spread. C, later, goes bad at position
    # 9 while A is still bad: a position no request went bad at before, so possibly spread.
    a, b, c = Req("A", 0, 17, 40), Req("B", 0, 5, 40), Req("C", 20, 4, 20)
    sa, sb, sc = a.step_at(20), b.step_at(20), c.step_at(9)
    assert sb - sa == 12 and a.start + a.steps > sc > sb  # A still decodes, bad, then
    nan = {(sa, "A"): {20: 3}, (sb, "B"): {20: 3}, (sc, "C"): {9: 5}}
    p = tmp_path / "t.h5"
    write_run(p, [a, b, c], 45, nan)
    bad = _by(analyze_trace(p))
    assert [(r, bad[r].step, bad[r].position) for r in bad] == [
        ("A", sa, 20), ("B", sb, 20), ("C", sc, 9)]
    assert [bad[r].kind for r in bad] == ["independent_same_position"] * 2 + [
        "possibly_spread"]
    assert bad["B"].spread_from == [] and bad["C"].spread_from == ["A", "B"]
    assert f"2 {LINE} 20 (A, B; steps {sa}, {sb})" in analyze_trace(p).engine.same_spots[0].line
