"""HF and vLLM module names aligned, and which files are the ranks of one run.

vLLM fuses a decoder layer's q/k/v projections into `qkv_proj` and gate/up into `gate_up_proj`;
transformers keeps `self_attn.q_proj`, `k_proj`, `v_proj`, `mlp.gate_proj`, `up_proj`. A
producer is named in HF spelling: a fused vLLM layer by the HF layers it holds, joined with
`+` (`model.layers.3.self_attn.q_proj+k_proj+v_proj`), every other name as it is. Its `site`
is the fused unit both engines share (`model.layers.3.self_attn.qkv_proj`), so an HF q_proj
and a vLLM qkv_proj failure in one layer meet at one site. No torch import.
"""

from __future__ import annotations

import os
import re
from typing import Any

__all__ = ["align_producer", "producer_site", "run_key"]

# the fused vLLM layer -> the HF layers it holds (qforensics.engines.vllm.FUSED_NAMES; repeated
# here so that triage never imports the engine adapters)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PART_OF = {part: fused for fused, parts in FUSED.items() for part in parts}


def align_producer(name: str, hf_names: Any = None) -> str:
    """`name` in HF spelling. `hf_names`: the engine's own map (trace metadata
    environment.engine.hf_names, untrusted: used only when it is a list of strings)."""
    if not name:
        return name
    mapped = hf_names.get(name) if isinstance(hf_names, dict) else None
    base, _, leaf = name.rpartition(".")
    if isinstance(mapped, list) and mapped and all(isinstance(m, str) for m in mapped):
        parts = [m.rpartition(".")[2] for m in mapped[:8]]
        return f"{base}.{'+'.join(parts)}" if base else "+".join(parts)
    if leaf in FUSED:
        return f"{base}.{'+'.join(FUSED[leaf])}" if base else "+".join(FUSED[leaf])
    return name


def producer_site(name: str) -> str:
    """The fused unit a module belongs to, in vLLM spelling (other modules: the name)."""
    base, _, leaf = name.rpartition(".")
    head = leaf.split("+", 1)[0]
    fused = leaf if leaf in FUSED else _PART_OF.get(head)
    if fused is None:
        return name
    return f"{base}.{fused}" if base else fused


_DIGITS = re.compile(r"\d+")


def run_key(path: str, rank: int, world_size: int) -> str:
    """The files of one multi-rank run share a key: their directory and their name with the
    rank taken out (capture names them `NAME-RANK.h5`, or by a `{rank}` pattern). A
    single-rank trace is a run of its own."""
    if world_size <= 1:
        return os.path.abspath(path)
    d, name = os.path.split(os.path.abspath(path))
    hits = [m for m in _DIGITS.finditer(name) if int(m.group()) == rank]
    if hits:
        m = hits[-1]
        name = name[:m.start()] + "{rank}" + name[m.end():]
    return os.path.join(d, f"{name}#world{world_size}")
