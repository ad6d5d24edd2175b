"""What triage must find in conftest's small fleet, derived from how fleet_synth built it (never
from the tool's output)."""

from __future__ import annotations

from pathlib import Path

import fleet_synth


def expected_groups(specs: list[fleet_synth.Spec]) -> list[dict]:
    """Groups in the order triage ranks them: by count (incidents, the ranks of one run once),
    then by first time. Each: verdict, producer, cause words, count, traces (sorted paths)."""
    runs: dict[str, list[fleet_synth.Spec]] = {}
    for s in specs:
        if s.incident is None:
            continue
        key = s.path if s.world == 1 else str(Path(s.path).parent / "run7")
        runs.setdefault(key, []).append(s)
    groups: dict[tuple, dict] = {}
    for members in runs.values():
        first = min(members, key=lambda s: s.rank)  # rank 0 holds the NaN scale
        e = fleet_synth.expect(first)
        key = (e["verdict"], e.get("producer"), e.get("cause"), e.get("cause_index"))
        g = groups.setdefault(key, {"verdict": e["verdict"], "producer": e.get("producer"),
                                    "cause": e.get("cause"), "cause_index": e.get("cause_index"),
                                    "count": 0, "traces": [], "time": first.t0})
        g["count"] += 1
        g["traces"] += [m.path for m in members]
        g["time"] = min(g["time"], first.t0)
    out = sorted(groups.values(), key=lambda g: (-g["count"], g["time"]))
    for g in out:
        g["traces"] = sorted(g["traces"])
    return out


def cause_words(g: dict) -> str:
    return g["cause"] + (f" ({g['cause_index']})" if g.get("cause_index") else "")
