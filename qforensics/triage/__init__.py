"""Many traces -> incident groups, on Dask.

`qforensics triage` analyzes every trace of a fleet as one Dask task each (a local cluster of
processes by default, or an existing dask.distributed scheduler), groups the incidents by
signature (verdict, producer in HF spelling, cause and its index, the layer's quantization and
kernel, engine and torch versions, model), folds the ranks of one run into one incident, and
says what sets the affected traces apart from the healthy ones.

    >>> from qforensics.triage import triage_traces
    >>> fleet = triage_traces(["traces/"])          # doctest: +SKIP
    >>> fleet.groups[0].count                       # doctest: +SKIP

Pieces: summary.py (the per-trace task), names.py (HF/vLLM names, rank files of one run),
groups.py (incidents, signatures, discriminators), run.py (Dask), tables.py (Parquet, JSON),
html.py (the fleet report). Never prints; no torch import.
"""

from __future__ import annotations

from qforensics.triage.groups import Fleet, Group, build_fleet
from qforensics.triage.run import collect_traces, triage_traces
from qforensics.triage.summary import summarize_trace

__all__ = ["Fleet", "Group", "build_fleet", "collect_traces", "summarize_trace", "triage_traces"]
