"""Runs llmcompressor's ``oneshot`` in llmcompressor's own venv (scripts/install-llmc.sh).

``python -m qforensics.whatif.llmc_worker MODEL_DIR OUT_DIR --algo gptq|sq-gptq --preset W4A16
--group N --calib FILE --samples N --seq-len L --ignore NAME...``

- MODEL_DIR: an HF folder of the model what-if measures (written by the main environment:
  whatever transformers there loaded, GGUF included, is handed over as plain safetensors).
- the calibration data: FILE's text tokenized by the model's tokenizer and cut into
  ``--samples`` consecutive, non-overlapping windows of ``--seq-len`` tokens (fewer when the
  text is shorter), in order: a local text, never a hub data set, never the evaluation text.
- the recipe: ``GPTQModifier`` (``gptq``), or ``SmoothQuantModifier`` then ``GPTQModifier``
  (``sq-gptq``, llmcompressor's W8A8 recipe), on every Linear but lm_head and the ``--ignore``
  names, with compressed-tensors' preset scheme (its group size set to ``--group``).
- OUT_DIR: the checkpoint ``save_pretrained(save_compressed=True)`` writes (compressed-tensors
  format), its tokenizer, and ``llmc.json`` (versions, recipe, samples, seconds).

Progress goes to stderr. A failure exits 3 with one last line ``LLMC-ERROR: <type>: <message>``
(the library's own words), which the caller reports. This module imports only what the llmc venv
has (torch, transformers, datasets, llmcompressor, compressed-tensors) and the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ERROR_TAG = "LLMC-ERROR: "
SMOOTHING = 0.8  # llmcompressor's W8A8 example recipe


def _say(msg: str) -> None:
    print(f"llmc: {msg}", file=sys.stderr, flush=True)


def calibration_windows(ids: list[int], samples: int, seq_len: int) -> list[list[int]]:
    """Consecutive non-overlapping windows of ``seq_len`` tokens, at most ``samples``."""
    return [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)][:samples]


def _scheme(preset: str, group: int | None):  # -> QuantizationScheme
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group is not None:
        scheme = scheme.model_copy(update={"weights": scheme.weights.model_copy(
            update={"group_size": int(group)})})
    return scheme


def recipe(algo: str, preset: str, group: int | None, ignore: list[str]) -> list:
    from llmcompressor.modifiers.gptq import GPTQModifier

    gptq = GPTQModifier(config_groups={"group_0": _scheme(preset, group)},
                        ignore=["lm_head", *ignore])
    if algo == "gptq":
        return [gptq]
    if algo == "sq-gptq":
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

        return [SmoothQuantModifier(smoothing_strength=SMOOTHING), gptq]
    raise ValueError(f"unknown algorithm {algo!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--algo", required=True, choices=["gptq", "sq-gptq"])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--group", type=int, default=None)
    ap.add_argument("--calib", required=True)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--ignore", nargs="*", default=[])
    a = ap.parse_args(argv)
    from qforensics.lifeline import watch_parent

    watch_parent()  # a whatif killed outright takes this worker with it
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    t0 = time.time()
    try:
        import compressed_tensors
        import llmcompressor
        import torch
        from datasets import Dataset
        from llmcompressor import oneshot
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(max(1, torch.get_num_threads()))
        _say(f"llmcompressor {llmcompressor.__version__}, loading {a.model}")
        tok = AutoTokenizer.from_pretrained(a.model)
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
        with open(a.calib, encoding="utf-8") as fh:
            ids = tok(fh.read())["input_ids"]
        wins = calibration_windows(list(ids), a.samples, a.seq_len)
        if not wins:
            raise ValueError(f"{a.calib}: {len(ids)} tokens, fewer than one window of "
                             f"{a.seq_len}")
        ds = Dataset.from_dict({"input_ids": wins, "attention_mask": [[1] * len(w) for w in wins]})
        rec = recipe(a.algo, a.preset, a.group, a.ignore)
        _say(f"{' + '.join(type(m).__name__ for m in rec)} on {len(wins)} x {a.seq_len} tokens "
             f"of {os.path.basename(a.calib)} (minutes on a small CPU)")
        oneshot(model=model, dataset=ds, recipe=rec, num_calibration_samples=len(wins),
                max_seq_length=a.seq_len, shuffle_calibration_samples=False)
        _say(f"calibrated in {time.time() - t0:.0f} s; writing the compressed checkpoint")
        model.save_pretrained(a.out, save_compressed=True)
        tok.save_pretrained(a.out)
        info = {"llmcompressor": llmcompressor.__version__,
                "compressed_tensors": compressed_tensors.__version__,
                "transformers": __import__("transformers").__version__,
                "torch": torch.__version__, "recipe": [repr(m) for m in rec],
                "modifiers": [type(m).__name__ for m in rec], "algo": a.algo,
                "preset": a.preset, "group": a.group, "ignore": ["lm_head", *a.ignore],
                "calibration": {"file": os.path.basename(a.calib), "samples": len(wins),
                                "seq_len": a.seq_len, "text_tokens": len(ids)},
                "seconds": round(time.time() - t0, 1)}
        with open(os.path.join(a.out, "llmc.json"), "w", encoding="utf-8") as fh:
            json.dump(info, fh, indent=2)
    except Exception as exc:  # noqa: BLE001 - the caller reports the library's own words, never a traceback
        import traceback

        traceback.print_exc(file=sys.stderr)
        msg = " ".join(str(exc).split())[:900]
        print(f"{ERROR_TAG}{type(exc).__name__}: {msg}", file=sys.stderr, flush=True)
        return 3
    _say(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
