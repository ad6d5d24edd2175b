"""The trace-time side of compiled mode: the forward hooks that torch.compile traces into the
graph (each recorded tensor queued, `_queue`; one stats-op call per decoder layer, or per
module outside any layer, `_flush`), each tensor's entry in the ring given
once at trace time (`_place`), the channel bound of a module known before it runs, and the
self-test that says whether this torch traces the hooks at all. The ring and the host's view of
it are hooks/graphstats.py's."""

from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch

from qforensics.hooks import opcall
from qforensics.hooks.callhooks import HIDDEN_KWARGS as _HIDDEN_KWARGS
from qforensics.hooks.graphstats import QUEUE, GraphStats, registered
from qforensics.hooks.reduce import dtype_code
from qforensics.trace import schema


# The traced side is kept to few Python operations: Dynamo executes every one of them
# symbolically at trace time, for each hooked module (on SmolLM2 the hooks once doubled the
# time Dynamo spent tracing the model). What can be computed from constants is, in one call
# that Dynamo runs for real (`assume_constant_result`): `_place`, `_group`.


@torch._dynamo.assume_constant_result
def _place(key: int, mid: int, io: int, slot: int, width: int, dtype: torch.dtype, dim: int
           ) -> int:
    """A tensor's entry (-1: none: no room, a dtype the op does not take, a capture closed).
    Run by Dynamo once, at trace time (its result is a constant of the graph); called
    eagerly, a dict look-up."""
    gs = registered(key)
    if gs is None:
        return -1
    if not (dtype.is_floating_point or dtype == torch.bool or _is_int(dtype)):
        gs.not_taken(mid, io, slot, str(dtype).replace("torch.", ""))
        return -1
    return gs.place(mid, io, slot, width if dim >= 2 else 1, dtype_code(dtype),
                    not dtype.is_floating_point)[0]


def _queue(key: int, mid: int, io: int, slot: int, bound: int, t: torch.Tensor) -> None:
    """One tensor into the queue of the next op call, with its entry; the arguments but the
    tensor are constants of the graph."""
    e = _place(key, mid, io, slot, bound, t.dtype, t.dim())
    if e >= 0:
        QUEUE.append((t.detach() if t.requires_grad else t, e))


@torch._dynamo.assume_constant_result
def _group(key: int, ents: tuple[int, ...]) -> tuple[tuple[Any, ...], ...]:
    """The op calls of the queued entries `ents`: one per run of them in one ring segment
    (one, but where a segment filled up), each (segment, first, end, offsets, caps, token
    rows, entries, pairs), constants of the graph; computed once per group (`_groups`)."""
    gs = registered(key)
    if gs is None:
        return ()
    got = gs.groups.get(ents)
    if got is None:
        got = gs.groups[ents] = _calls(gs, ents)
    return got


def _calls(gs: GraphStats, ents: tuple[int, ...]) -> tuple[tuple[Any, ...], ...]:
    out = []
    i = 0
    while i < len(ents):
        seg = gs.entries[ents[i]].seg
        j = i + 1
        while j < len(ents) and gs.entries[ents[j]].seg == seg:
            j += 1
        grp = [gs.entries[e] for e in ents[i:j]]
        out.append((seg, i, j, tuple(g.off for g in grp), tuple(g.cap for g in grp),
                    tuple(g.tok for g in grp), tuple(ents[i:j]), _pairs(grp, gs.gemm)))
        i = j
    return tuple(out)


def _flush(gs: GraphStats) -> None:
    """What the hooks queued, in one stats-op call per ring segment: a decoder layer's
    tensors, or a module's outside any layer."""
    items = list(QUEUE)
    QUEUE.clear()
    ts = [t for t, _ in items]
    for seg, i, j, offs, caps, toks, ents, pairs in _group(gs.key, tuple(e for _, e in items)):
        torch.ops.qforensics.stats(ts[i:j], getattr(gs, f"r{seg}"), gs.toks, gs.first,
                                   gs.step_t, offs, caps, toks, ents, gs.snap.buf, pairs)


def _pairs(grp: list[Any], gemm: frozenset[int] = frozenset()) -> tuple[int, ...]:
    """The op's `pair` of a group (its entries' module, io and slot): for an output, the
    index of its module's `input.0` in the group (itself when the group has none), kept with
    it when it is the first failing output; for the float `input.0` of a GEMM module (`gemm`)
    whose `output.0` is in the group, -2 - that output's index: a candidate for the first
    outlier's snapshot; -1 for any other input."""
    first_in = {g.mid: k for k, g in reversed(list(enumerate(grp)))
                if g.io == schema.IO_INPUT and g.slot == 0}
    first_out = {g.mid: k for k, g in reversed(list(enumerate(grp)))
                 if g.io == schema.IO_OUTPUT and g.slot == 0}
    return tuple(first_in.get(g.mid, k) if g.io == schema.IO_OUTPUT else
                 -2 - first_out[g.mid] if (g.slot == 0 and g.mid in gemm and not g.nonfloat
                                           and g.mid in first_out) else -1
                 for k, g in enumerate(grp))


def record_outside(gs: GraphStats, mid: int, io: int, slot: int, bound: int,
                   t: torch.Tensor) -> bool:
    """A tensor of a call outside the compiled region (the logits; vLLM's lm_head and row
    flags) queued for the op, which runs eagerly at the step's end (`flush_outside`): one
    call for all of them, so a tensor recorded twice (vLLM's logits, as lm_head's output and
    as the step's) is reduced once. Its call index follows the step's compiled calls, modules
    in the order of their first such call (`collect`). False: a dtype the op does not take
    (unrecorded; `_place` says so in the status)."""
    if not (t.is_floating_point() or t.dtype == torch.bool or _is_int(t.dtype)):
        gs.not_taken(mid, io, slot, str(t.dtype).replace("torch.", ""))
        return False
    if mid not in gs.outside:
        gs.outside[mid] = len(gs.outside)
    _queue(gs.key, mid, io, slot, bound, t)
    return True


def flush_outside(gs: GraphStats) -> None:
    """The op call of what `record_outside` queued this step (nothing queued: nothing); run
    before the ring is read, and before the next forward (whose trace must find the queue
    empty)."""
    if QUEUE:
        _flush(gs)


def _is_int(dt: torch.dtype) -> bool:
    return dt in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _tensors(items: Iterable[Any], limit: int) -> list[torch.Tensor]:
    """The first `limit` tensors among `items`."""
    out: list[torch.Tensor] = []
    for a in items:
        if isinstance(a, torch.Tensor):
            out.append(a)
            if len(out) >= limit:
                break
    return out


_WIDTH_ATTRS = ("in_features", "out_features", "input_size", "output_size",
                "input_size_per_partition", "output_size_per_partition", "embedding_dim",
                "hidden_size", "normalized_shape")


def width_bound(module: torch.nn.Module, channel_limit: int) -> int:
    """The most channels any tensor of this module's calls is expected to have, known before
    it runs: its widest parameter dimension or declared size (packed INT4 weights are narrower
    than the layer), at most `channel_limit`."""
    dims = [int(d) for p in module.parameters(recurse=True) for d in p.shape[-2:]]
    for sub in module.modules():
        for a in _WIDTH_ATTRS:
            v = getattr(sub, a, None)
            if isinstance(v, int):
                dims.append(v)
            elif isinstance(v, (tuple, list)) and v and isinstance(v[-1], int):
                dims.append(int(v[-1]))
    return max(1, min(max(dims, default=channel_limit), channel_limit))


# A hook's constants are written into its code, not held in closure cells: Dynamo guards a
# closure cell's value at every call of the compiled model (about six guards per hooked
# module), a constant of the code not at all (the code's identity, once). Its capture's
# GraphStats is reached through `registered`, one source for every hook.
_HOOK = """
def hook(module, args, kwargs, output):
    if not torch.compiler.is_compiling():
        _eager_call({key}, {mid}, {n_in}, {n_out}, {bound}, args, kwargs, output)
        return None
    ins = _tensors(args, {n_in})
    if not ins:
        ins = _tensors([kwargs.get(k) for k in _HIDDEN_KWARGS], 1)
    for slot, a in enumerate(ins):
        _queue({key}, {mid}, {io_in}, slot, {bound}, a)
    outs = (output,) if isinstance(output, torch.Tensor) else (
        output if isinstance(output, (tuple, list)) else ())
    for slot, o in enumerate(_tensors(outs, {n_out})):
        _queue({key}, {mid}, {io_out}, slot, {bound}, o)
    {flush}
"""



def make_hook(gs: GraphStats, mid: int, is_block: bool, bound: int, max_inputs: int,
              max_outputs: int, flush: bool = True):
    """The forward hook (with kwargs) of one module: the same tensors as the eager capture's
    `_on_call` takes (its first tensor arguments, else a hidden-state keyword; its first
    outputs; a decoder block one of each), queued when traced. `flush`: this traced hook hands
    the queue to the op (a decoder block, after its modules' hooks queued theirs; a module
    outside any block); False for a module inside a hooked block. Run eagerly (a model that
    is not compiled, a graph break), every hook hands its tensors to the op at once
    (`_eager_call`), since the model may change them in place before the block's hook
    (vLLM's fused add-RMSNorm does). Dynamo reads is_compiling() as True: nothing of the
    eager branch reaches the graph."""
    src = _HOOK.format(n_in=1 if is_block else int(max_inputs),
                       n_out=1 if is_block else int(max_outputs), key=int(gs.key),
                       mid=int(mid), bound=int(bound), io_in=int(schema.IO_INPUT),
                       io_out=int(schema.IO_OUTPUT),
                       flush=f"_flush_key({int(gs.key)})" if flush else "")
    ns: dict[str, Any] = {}
    exec(compile(src, f"<qforensics hook {int(mid)}>", "exec"), globals(), ns)  # noqa: S102
    return ns["hook"]


def _eager_call(key: int, mid: int, n_in: int, n_out: int, bound: int, args: Any,
                kwargs: dict[str, Any], output: Any) -> None:
    """A hook run eagerly: its tensors to the op in one call. Its first run with a given
    (module, run in the step, tensors' dtypes) places them as a traced hook would (`_place`,
    `_group`) and keeps the op calls that came out (`GraphStats.eager`); a later run with the
    same key calls the op with them, nothing placed or grouped (most of an eager hook's cost
    was there: ~20 us a call against ~7 for the op)."""
    gs = registered(key)
    if gs is None:
        return
    try:
        _eager_take(gs, key, mid, n_in, n_out, bound, args, kwargs, output)
    except Exception as exc:  # noqa: BLE001 - never break the run: capture degrades
        gs.fail(exc)


def _eager_take(gs: GraphStats, key: int, mid: int, n_in: int, n_out: int, bound: int,
                args: Any, kwargs: dict[str, Any], output: Any) -> None:
    ins = _tensors(args, n_in)
    if not ins:
        ins = _tensors([kwargs.get(k) for k in _HIDDEN_KWARGS], 1)
    outs = _tensors((output,) if isinstance(output, torch.Tensor) else (
        output if isinstance(output, (tuple, list)) else ()), n_out)
    ts = ins + outs
    if not ts:
        return
    if QUEUE:  # what a traced region left queued (Dynamo replays its appends after a graph)
        _flush(gs)
    eager = gs._trace is None  # eager since the step began (else after a trace attempt)
    run = gs.runs.get(mid, 0) if eager else 0
    sig = (mid, run, len(ins), *[t.dtype for t in ts])
    plan = gs.eager.get(sig) if eager else None
    if plan is None:
        keys = _keys(len(ins), len(outs))
        if eager:  # `place` counts runs per (module, io, slot): from this module's so far
            for k in keys:
                gs._occ[(mid, *k)] = run
        # (after a trace attempt, `place` restarts the count at this run: the run is 0)
        placed = [(i, _place(key, mid, io, slot, bound, t.dtype, t.dim()))
                  for i, ((io, slot), t) in enumerate(zip(keys, ts))]
        placed = [(i, e) for i, e in placed if e >= 0]
        plan = (tuple(i for i, _ in placed),
                tuple((getattr(gs, f"r{c[0]}"), *c[1:]) for c in _group(
                    key, tuple(e for _, e in placed))),
                [None])  # its calls' OpCalls (hooks/opcall.py), made at its first call
        if eager:
            gs.eager[sig] = plan
    gs.runs[mid] = run + 1
    _call_plan(gs, ts, plan)


def _keys(n_in: int, n_out: int) -> list[tuple[int, int]]:
    return ([(schema.IO_INPUT, s) for s in range(n_in)]
            + [(schema.IO_OUTPUT, s) for s in range(n_out)])


def _call_plan(gs: GraphStats, ts: list[torch.Tensor], plan: tuple[Any, ...]) -> None:
    """An eager hook's op calls. On the CPU each goes first to its OpCall (hooks/opcall.py:
    the op kernel's reduction without the dispatcher), and to the op only when that leaves
    something for it to do (a NaN/Inf, a strided tensor...)."""
    idx, calls, lanes = plan
    xs = [t.detach() if t.requires_grad else t for t in (ts if len(idx) == len(ts) else
                                                          [ts[i] for i in idx])]
    fast = lanes[0]
    if fast is None:
        fast = lanes[0] = opcall.lanes(gs, calls)
        if fast:
            gs.op_calls.extend(fast)
    for k, (ring, i, j, offs, caps, toks, ents, pairs) in enumerate(calls):
        part = xs if i == 0 and j == len(xs) else xs[i:j]
        if fast and fast[k](part):
            continue
        torch.ops.qforensics.stats(part, ring, gs.toks, gs.first, gs.step_t, offs, caps,
                                   toks, ents, gs.snap.buf, pairs)


def _flush_key(key: int) -> None:
    gs = registered(key)
    if gs is not None:
        _flush(gs)


def max_entries(modules: list[torch.nn.Module], is_block: list[bool], max_inputs: int,
                max_outputs: int) -> int:
    """Entries a capture may place at most: each module's recorded inputs and outputs (a
    decoder block one of each; a module no more inputs than its forward takes positionally,
    `positional_inputs`). It sizes the token ring's columns, which a GPU allocates whole."""
    return sum(2 if blk else min(max_inputs, positional_inputs(m)) + max_outputs
               for m, blk in zip(modules, is_block))


def positional_inputs(module: torch.nn.Module) -> int:
    """The most tensors a forward hook of `module` can find among its positional arguments
    (at least 1: a hidden-state keyword stands in when there is none); unknown (a *args
    forward, no signature): a large number."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return 1 << 30
    n = 0
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            return 1 << 30
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            n += 1
    return max(1, n)


def selftest(device: torch.device) -> str | None:
    """Trace a hooked toy module the way vLLM compiles (full graph, backend eager): None when
    it traces, else why not (then capture records no layer in compiled regions)."""
    try:
        lin = torch.nn.Linear(8, 4).to(device)
        gs = GraphStats(entries=4, tok_rows=16, device=device, channel_limit=64,
                        channel_io="all")
        try:
            h = lin.register_forward_hook(make_hook(gs, 0, False, 8, 2, 2), with_kwargs=True)
            fn = torch.compile(lambda x: lin(x) * 2, fullgraph=True, backend="eager",
                               dynamic=True)
            x = torch.ones(3, 8, device=device)
            gs.begin(5)
            fn(x)
            h.remove()
            got = gs.collect(5, 0, True)
            if got is None or len(got["records"]) != 2 or got["records"]["rows"][0] != 3:
                return "a traced hook wrote nothing"
        finally:
            gs.close()
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means: do not trust the path
        return f"{type(exc).__name__}: {str(exc)[:300]}"
