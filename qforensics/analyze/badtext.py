"""A request that went bad in a serving-engine run (BadRequest; analyze/badrequests.py finds
them) and the text of those findings: each request's line, the groups that went bad on their own
at one position or length, and the requests that went bad first in their own attention after
others (the KV cache). No torch import."""

from __future__ import annotations

from dataclasses import dataclass, field

CAUSES = "a rotary table, a kernel that switches at a size, a KV block boundary"


@dataclass
class BadRequest:
    """One request that went bad, at the first step its rows or its logits row held NaN/Inf."""

    request_id: str
    step: int
    position: int | None  # where its NaN/Inf appeared first (None: not recorded)
    length: int | None  # its sequence length after that step's tokens (last position + 1)
    prompt_tokens: int | None
    phase: str
    rows: int
    logits: bool
    token: int | None  # the input token id at `position` in that step (None: not recorded)
    first_module: str  # the earliest hooked call of that forward holding its NaN/Inf ("")
    # independent_same_position | independent_same_length | independent | possibly_spread |
    # possibly_via_kv_cache | undetermined
    kind: str = "undetermined"
    spread_from: list[str] = field(default_factory=list)  # bad before, NaN in the same forward
    # others bad at an earlier op of that forward that the trace cannot name (its step's full
    # detail is past the budget; /engine/hits counts them)
    spread_unnamed: int = 0
    # bad before it in the run, when its NaN/Inf came first out of its own attention (its
    # inputs there finite): KV blocks they left may be what it read
    kv_from: list[str] = field(default_factory=list)
    together_with: list[str] = field(default_factory=list)  # first bad in the same forward too
    same_position_as: list[str] = field(default_factory=list)  # same first bad position
    same_length_as: list[str] = field(default_factory=list)  # same length there
    line: str = ""


@dataclass
class SameSpot:
    """Requests that went bad on their own at one position (or, else, at one length)."""

    by: str  # position | length
    value: int
    requests: list[str]
    steps: list[int]
    tokens: list[int | None]
    line: str = ""


def _ids(xs: list[str]) -> str:
    return ", ".join(xs[:4]) + (f" (+{len(xs) - 4} more)" if len(xs) > 4 else "")


_ATTN_OUT = "self_attn.o_proj"  # its input is the attention's output (Llama-family names)


def reached_on_its_own(bad: list[BadRequest]) -> None:
    """Requests that went bad at one position, each when it reached it (a rotary table row, a
    KV block boundary, a kernel that switches at a length), went bad on their own: the
    position is the likelier cause than a request bad in the same forward or the KV cache.
    A spread is read only at a position no other request went bad at."""
    seen: dict[int, int] = {}
    for b in bad:
        if b.position is not None:
            seen[b.position] = seen.get(b.position, 0) + 1
    for b in bad:
        if b.position is None or seen[b.position] < 2 \
                or not b.kind.startswith(("possibly_", "independent")):
            continue
        b.kind, b.spread_from, b.spread_unnamed, b.kv_from = "independent", [], 0, []
        b.line = request_line(b, [], {}, [])


def mark_via_kv_cache(bad: list[BadRequest]) -> None:
    """A request on its own in its forward whose NaN/Inf appeared first in its attention's
    output, after requests went bad earlier in the run: it read KV blocks, and a freed block
    the engine did not clear (or a shared prefix block) can hold their NaN."""
    for b in bad:
        before = [x.request_id for x in bad if x.step < b.step]
        shared = b.position is not None and any(
            x is not b and x.position == b.position for x in bad)
        if b.kind == "independent" and b.first_module.endswith(_ATTN_OUT) and before \
                and not shared:
            b.kind, b.kv_from = "possibly_via_kv_cache", before[::-1][:4]
            b.line = request_line(b, [], {}, [])


def group_same_spots(bad: list[BadRequest]) -> list[SameSpot]:
    spots: list[SameSpot] = []
    for by in ("position", "length"):
        groups: dict[int, list[BadRequest]] = {}
        for b in bad:
            v = getattr(b, by)
            if b.kind == "independent" and v is not None:
                groups.setdefault(v, []).append(b)
        for v, g in sorted(groups.items()):
            if len(g) < 2:
                continue
            for b in g:
                b.kind = f"independent_same_{by}"
            sp = SameSpot(by, v, [b.request_id for b in g], [b.step for b in g],
                          [b.token for b in g])
            toks = set(sp.tokens)
            tok = ""
            if None not in toks and len(toks) == 1:
                tok = (f"; all with input token {sp.tokens[0]} there, so that token may be the "
                       "cause as well")
            elif None not in toks:
                tok = "; with different input tokens there"
            steps = _ids([str(x) for x in sp.steps])
            sp.line = (f"{len(g)} requests went bad on their own at {by} {v} "
                       f"({_ids(sp.requests)}; steps {steps}): points to a position- or "
                       f"length-dependent cause ({CAUSES}){tok}")
            spots.append(sp)
    return spots


def request_head(b: BadRequest) -> str:
    where = f"position {b.position}" if b.position is not None else "an unrecorded position"
    extra = [f"length {b.length}"] if b.length is not None else []
    if b.prompt_tokens is not None:
        extra.append(f"prompt {b.prompt_tokens} tokens")
    return (f"request {b.request_id}: went bad at step {b.step} ({b.phase}) at {where}"
            + (f" ({', '.join(extra)})" if extra else "")
            + (f", first in {b.first_module or '(model output)'}" if b.first_module else ""))


def request_line(b: BadRequest, carriers: list[str], since: dict[str, int], others: list[str],
          same: list[str] = ()) -> str:
    """`carriers`: the requests bad before it in that forward (for a same-position or -length
    kind: the others of its group); `others`: every other request bad in that forward; `same`:
    those of them that went bad at the same op, for the first time."""
    head = request_head(b)
    if b.kind.startswith("independent_same_"):
        return head + (f": on its own, at the same {b.kind.rsplit('_', 1)[1]} as "
                       + _ids(carriers))
    if b.kind == "independent":
        if not others:
            return head + ": on its own (no other request held NaN/Inf in that forward)"
        later = [x for x in others if x not in same]
        why = ([f"at an earlier op of that forward than {_ids(later)}"] if later else []) + (
            [f"at the same op as {_ids(same)}, bad for the first time too"] if same else [])
        return head + f": on its own ({'; '.join(why)})"
    if b.kind == "possibly_via_kv_cache":
        return head + (": possibly through the KV cache: NaN/Inf first in its attention's "
                       "output, its inputs there finite, after " + _ids(b.kv_from)
                       + " went bad (a freed KV block not cleared, or a shared prefix block)")
    if b.kind == "possibly_spread" and not b.spread_from:
        return head + (f": possibly spread: {b.spread_unnamed} other request(s) held NaN/Inf at "
                       "an earlier op of that forward (not named: that step's full detail is "
                       "past the byte budget)")
    if b.kind == "possibly_spread":
        src = "; ".join(f"{x} (bad since step {since[x]})" if x in carriers else x
                        for x in b.spread_from[:4])
        return head + (f": possibly spread from {src}, NaN/Inf in the same forward (an op "
                       "that mixes the batch's rows, or shared prefix KV blocks)")
    return head + (f": went bad in the same forward as {_ids(b.together_with)}; which reached "
                   "which is not recorded")
