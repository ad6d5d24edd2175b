"""JSON Schemas (draft 2020-12) of the documents qforensics writes, and of the module info rows
inside a trace: one place that says what a reader may rely on.

Each schema pins the envelope (`schema`, `version`, from qforensics/jsondoc.py), the keys a
reader needs and their types, and the one non-finite policy (a float may be the string "nan",
"inf" or "-inf"). Keys not named here are allowed: a minor version may add them
(docs/json.md). The prose descriptions stay in the docs each entry names; `validate` checks a
document with the jsonschema library (imported when called: pip install jsonschema, part of the
test extra). Standard library only at import.
"""

from __future__ import annotations

from typing import Any

from qforensics.jsondoc import SCHEMAS

# the what-if document's words, defined here (below whatif in the layers) and used there:
# whatif/risk.py's levels, whatif/recommend.py's target metrics (with their wording)
WHATIF_RISK_LEVELS = ("high", "elevated", "low", "none", "unknown")
WHATIF_METRICS = {"recovered": "recovered perplexity (ppl_ref / ppl)",
                  "top1": "text top-1 agreement with the reference"}

__all__ = ["DOCUMENTS", "MODULE_INFO", "validate", "validate_module_info"]

_NUM = {"anyOf": [{"type": "number"}, {"enum": ["nan", "inf", "-inf"]}]}
_NUM_OR_NULL = {"anyOf": [_NUM, {"type": "null"}]}
_INT = {"type": "integer"}
_STR = {"type": "string"}
_VERDICT = {"type": "object", "required": ["status", "line"],
            "properties": {"status": {"enum": ["PASSED", "SUSPECT", "FAILED"]}, "line": _STR}}


_OBJ_OR_NULL = {"type": ["object", "null"]}
# one scheme of a what-if document (qforensics/whatif/results.py SchemeResult.to_json)
_WHATIF_SCHEME = {
    "type": "object",
    "required": ["scheme", "weights", "activations", "top1", "kl", "ppl", "text_top1",
                 "recovered", "nonfinite", "text", "seconds", "vllm", "error", "memory",
                 "memory_vs_bf16", "engine_memory_vs_bf16", "decode_speed_vs_bf16",
                 "prefill_speed_vs_bf16", "risk", "path"],
    "properties": {
        "scheme": _STR, "weights": {"type": ["string", "null"]},
        "activations": {"type": ["string", "null"]}, "top1": _NUM, "kl": _NUM, "ppl": _NUM,
        "text_top1": _NUM, "recovered": _NUM, "nonfinite": {"type": "boolean"}, "text": _STR,
        "seconds": _NUM, "vllm": _OBJ_OR_NULL, "error": {"type": ["string", "null"]},
        "library": _OBJ_OR_NULL, "memory": _OBJ_OR_NULL, "memory_vs_bf16": _NUM_OR_NULL,
        "engine_memory_vs_bf16": _NUM_OR_NULL, "decode_speed_vs_bf16": _NUM_OR_NULL,
        "prefill_speed_vs_bf16": _NUM_OR_NULL, "path": _STR,
        "risk": {"anyOf": [{"type": "null"}, {
            "type": "object", "required": ["level"],
            "properties": {"level": {"enum": list(WHATIF_RISK_LEVELS)}}}]},
    },
}
# whatif --target's recommendation (qforensics/whatif/recommend.py)
_WHATIF_RECOMMENDATION = {
    "type": "object", "required": ["target", "rule", "scheme", "candidates"],
    "properties": {
        "target": {"type": "object", "required": ["metric", "floor"], "properties": {
            "metric": {"enum": sorted(WHATIF_METRICS)}, "floor": _NUM, "words": _STR}},
        "rule": _STR, "scheme": {"type": ["string", "null"]},
        "meets": {"type": "array", "items": _STR},
        "candidates": {"type": "array", "items": {
            "type": "object", "required": ["scheme", "value", "from", "meets"],
            "properties": {"scheme": _STR, "value": _NUM, "from": _STR,
                           "meets": {"type": "boolean"}, "memory_vs_bf16": _NUM_OR_NULL,
                           "decode_speed_vs_bf16": _NUM_OR_NULL}}},
        "closest": _OBJ_OR_NULL, "needs": _OBJ_OR_NULL,
        "text": {"type": "array", "items": _STR}},
}


def _envelope(name: str, required: list[str], properties: dict[str, Any]) -> dict[str, Any]:
    major = SCHEMAS[name].split(".")[0]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": ["schema", "version", *required],
        "properties": {"schema": {"const": name},
                       "version": {"type": "string", "pattern": rf"^{major}\.[0-9]+$"},
                       **properties},
    }


_FIRST_NONFINITE = {"anyOf": [{"type": "null"}, {
    "type": "object", "required": ["step", "call_index", "module", "io", "nan_count", "inf_count"],
    "properties": {"step": _INT, "call_index": _INT, "module": _STR,
                   "io": {"enum": [0, 1]}, "tensor": _STR,  # io 0 input, 1 output
                   "nan_count": _INT, "inf_count": _INT,
                   "producer": {"type": ["string", "null"]}}}]}

_ANALYZE_ONE = {
    "type": "object",
    "required": ["trace", "rank", "world_size", "n_steps", "n_modules", "end", "verdict",
                 "first_nonfinite", "thresholds", "notes", "coverage"],
    "properties": {
        "trace": _STR, "rank": _INT, "world_size": _INT, "n_steps": _INT, "n_modules": _INT,
        "end": {"type": "object", "required": ["complete"],
                "properties": {"complete": {"type": "boolean"}}},
        "verdict": _VERDICT, "first_nonfinite": _FIRST_NONFINITE,
        "cause": {"type": ["object", "null"], "properties": {"kind": _STR, "line": _STR}},
        "outliers": {"type": "array"}, "damage": {"type": "array", "items": {
            "type": "object", "required": ["module", "scheme", "channels_zeroed",
                                           "channels_total", "unsafe"],
            "properties": {"scale": _NUM, "fraction": _NUM, "unsafe": {"type": "boolean"}}}},
        "thresholds": {"type": "object", "additionalProperties": _NUM},
        "notes": {"type": "array", "items": _STR},
        "coverage": {"type": "object", "required": ["steps_seen"]},
        "engine": {"type": ["object", "null"]},
    },
}

DOCUMENTS: dict[str, dict[str, Any]] = {
    # analyze --json (docs/analyze-json.md): one trace, or several ranks
    "qforensics.analyze": _envelope("qforensics.analyze", [], {}) | {"anyOf": [
        _ANALYZE_ONE,
        {"type": "object", "required": ["multi_rank", "verdict", "ranks"],
         "properties": {"multi_rank": {"const": True}, "verdict": _VERDICT,
                        "earliest": {"type": ["integer", "null"]},
                        "ranks": {"type": "array", "minItems": 1, "items": _ANALYZE_ONE}}},
    ]},
    # diff --json (docs/analyze-json.md)
    "qforensics.diff": _envelope("qforensics.diff", [
        "reference", "suspect", "verdict", "n_aligned", "steps_compared", "ranked"], {
        "reference": _STR, "suspect": _STR, "verdict": _VERDICT, "n_aligned": _INT,
        "steps_compared": {"type": "array", "items": _INT},
        "first_jump": {"type": ["object", "null"]},
        "ranked": {"type": "array", "items": {
            "type": "object", "required": ["module", "step", "io", "score"],
            "properties": {"module": _STR, "step": _INT, "score": _NUM, "sqnr_db": _NUM_OR_NULL,
                           "cosine": _NUM_OR_NULL}}}}),
    # scan --json (docs/scan.md)
    "qforensics.scan": _envelope("qforensics.scan", [
        "path", "verdict", "files_scanned", "tensors_scanned", "counts", "findings"], {
        "path": _STR, "verdict": {"enum": ["passed", "failed", "nothing_scanned"]},
        "files_scanned": _INT, "tensors_scanned": _INT,
        "counts": {"type": "object", "required": ["error", "warning"]},
        "findings": {"type": "array", "items": {
            "type": "object", "required": ["file", "tensor", "check", "severity", "message"],
            "properties": {"severity": {"enum": ["error", "warning"]}, "message": _STR}}}}),
    # triage --json (docs/triage.md)
    "qforensics.triage": _envelope("qforensics.triage", ["traces", "groups", "unreadable"], {
        "traces": _INT,
        "groups": {"type": "array", "items": {
            "type": "object", "required": ["verdict", "producer", "cause", "count", "traces"],
            "properties": {"verdict": {"enum": ["FAILED", "SUSPECT"]},
                           "producer": {"type": ["string", "null"]}, "count": _INT,
                           "traces": {"type": "array", "items": _STR}}}},
        "unreadable": {"type": "array", "items": {
            "type": "object", "required": ["path", "reason"],
            "properties": {"path": _STR, "reason": _STR}}}}),
    # whatif --json, read by report --whatif (docs/whatif.md, "JSON")
    "qforensics.whatif": _envelope("qforensics.whatif", [
        "trace", "prompt_source", "salient_source", "reference", "schemes", "recommendation"], {
        "trace": {"type": ["string", "null"]}, "prompt_source": _STR, "salient_source": _STR,
        "reference": {"type": "object", "required": ["text", "ppl", "positions", "text_tokens"],
                      "properties": {"text": _STR, "ppl": _NUM, "positions": _INT,
                                     "text_tokens": _INT}},
        "schemes": {"type": "array", "items": _WHATIF_SCHEME},
        "recommendation": {"anyOf": [{"type": "null"}, _WHATIF_RECOMMENDATION]}}),
    # replay --json, read by report --replay (docs/replay.md)
    "qforensics.replay": _envelope("qforensics.replay", [
        "created_by", "call_index", "module", "layout", "fixture", "shapes", "tile", "results"], {
        "fixture": {"type": "boolean"}, "shapes": {"type": "object"}, "tile": {"type": "object"},
        "results": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["verdict", "path", "summary", "errors"],
            "properties": {"verdict": {"enum": ["KERNEL FAULT", "KERNEL DIVERGES", "DATA",
                                                "NOT REPRODUCED", "INCONCLUSIVE"]},
                           "path": _STR, "summary": _STR, "errors": _INT,
                           "reason": {"type": ["string", "null"]}}}}}),
}

_HEALTH = {"type": "object", "properties": {
    "numel": _INT, "nan": _INT, "inf": _INT, "zero": _INT, "subnormal": _INT,
    "first_nonfinite": {"type": "object", "properties": {"index": _INT, "row": _INT}},
    "error": _STR}}

# one /modules/info row (docs/trace-format.md, "Module info"); readers must ignore other keys
MODULE_INFO: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "params": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["shape", "dtype"],
            "properties": {"shape": {"type": "array", "items": _INT}, "dtype": _STR}}},
        "quant": {"type": ["object", "null"], "properties": {
            "format": _STR, "bits": {"type": ["integer", "null"]},
            "group_size": {"type": ["integer", "null"]}}},
        "layout": _STR,
        "health": {"type": "object", "additionalProperties": _HEALTH},
        "tied": {"type": "array", "items": {"type": "array", "items": _STR}},
        "embedding": {"type": "object", "properties": {"name": _STR, "health": {
            "type": "object", "additionalProperties": _HEALTH}}},
    },
}


def _problems(doc: Any, schema: dict[str, Any]) -> list[str]:
    try:
        import jsonschema
    except ImportError as exc:  # pragma: no cover - the test extra installs it
        raise ImportError("validating needs jsonschema: pip install jsonschema") from exc
    v = jsonschema.Draft202012Validator(schema)
    out = []
    for e in v.iter_errors(doc):
        if e.context:  # anyOf: say what is wrong in the branch that came closest
            e = jsonschema.exceptions.best_match(e.context)
        out.append(f"{'/'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message[:300]}")
    return sorted(out)


def validate(doc: Any) -> list[str]:
    """What is wrong with a qforensics JSON document, by its `schema` key ([] when nothing)."""
    name = doc.get("schema") if isinstance(doc, dict) else None
    if name not in DOCUMENTS:
        return [f"(root): not a document with a known schema: {name!r}"]
    return _problems(doc, DOCUMENTS[name])


def validate_module_info(row: Any) -> list[str]:
    """What is wrong with one module info row of a trace ([] when nothing)."""
    return _problems(row, MODULE_INFO)
