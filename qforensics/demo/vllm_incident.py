"""A served incident, end to end: a checkpoint that stays healthy for ordinary traffic and goes
bad only for the requests that carry one rare word, served by vLLM's OpenAI-compatible server
under `qforensics record`, with a client that sends healthy traffic for minutes before the
first such request arrives.

The corruption: the embedding row of the rare word is NaN. SmolLM2 ties lm_head to the
embedding, and a NaN row there would put a NaN logit into every request from the first step
on; so the incident checkpoint unties them (lm_head keeps the original rows, as in a fine-tune
that trained its head separately), and the bad row stays latent until a prompt holds the word.
The poisoned requests are long ones, with the word at a different position in each.

The test (tests/engines/test_vllm_incident.py) runs this in minutes with a small budget and an
early trigger; bench/served_incident.py runs it for ten minutes and more and prints the
trace's size over time. Knows nothing of qforensics' internals: it drives the CLI and the
server as a user would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable

RARE_WORD = " chimpanzee"  # one token of SmolLM2's vocabulary; absent from the healthy texts


def incident_checkpoint(src: Path, dst: Path, word: str = RARE_WORD) -> int:
    """Copy the bf16 folder `src` to `dst` with lm_head untied (its rows the embedding's) and
    the embedding row of `word` set to NaN; returns that row's token id."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(src)(word, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"{word!r} is {len(ids)} tokens, not one")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    sd = load_file(str(src / "model.safetensors"))
    emb = sd["model.embed_tokens.weight"]
    sd["lm_head.weight"] = emb.clone()
    bad = emb.clone()
    bad[ids[0]] = float("nan")
    sd["model.embed_tokens.weight"] = bad
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    assert torch.isnan(bad[ids[0]]).all() and torch.isfinite(sd["lm_head.weight"]).all()
    return int(ids[0])


def healthy_texts() -> list[str]:
    """Paragraphs of the packaged healthy texts: the prompts of ordinary traffic."""
    out = []
    for name in ("calibration.txt", "perplexity.txt"):
        txt = resources.files("qforensics.data").joinpath(name).read_text(encoding="utf-8")
        out += [p.strip() for p in txt.split("\n\n") if len(p.strip()) > 40]
    return out


def poisoned_prompt(i: int, word: str = RARE_WORD) -> str:
    """A long prompt (several paragraphs) with `word` placed after its (3 + 7 i)-th word, so that
    each poisoned request holds it at a different position."""
    words = " ".join(healthy_texts()[i % 4:i % 4 + 3]).split()
    k = 3 + 7 * i
    return " ".join(words[:k]) + word + " " + " ".join(words[k:])


def free_port() -> int:
    """A TCP port free on loopback now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(model_dir: Path, trace: str, port: int, *, compiled: bool,
                   max_bytes_mib: float, max_model_len: int = 1024) -> list[str]:
    """`qforensics record -o TRACE --max-bytes-mib B -- python -m vllm...api_server ...`."""
    cmd = [sys.executable, "-m", "qforensics.cli", "record", "-o", trace,
           "--max-bytes-mib", str(max_bytes_mib), "--", sys.executable, "-m",
           "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "m", "--max-model-len", str(max_model_len),
           "--port", str(port), "--host", "127.0.0.1"]
    return cmd if compiled else cmd + ["--enforce-eager"]


def start_server(cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen:
    """In a process group of its own, so that a stop reaches the engine and its workers."""
    f = open(log, "w")  # noqa: SIM115 - the server's life is longer than this call
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_ready(proc: subprocess.Popen, port: int, timeout: float, log: Path) -> float:
    """Seconds until the server answers /v1/models; raises with the log's tail if it dies."""
    t0 = time.time()
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
            return time.time() - t0
        except OSError:
            if proc.poll() is not None or time.time() - t0 > timeout:
                tail = log.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"the server did not come up (rc {proc.poll()}):\n{tail}")
            time.sleep(1)


def stop(proc: subprocess.Popen, sig: int = signal.SIGKILL, timeout: float = 120) -> int | None:
    """Send `sig` to the server's whole process group (kill -9 by default: a crashed pod)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(timeout=30)


@dataclass
class Sent:
    """One request as the client saw it."""

    t_sent: float
    t_done: float
    prompt: str
    poisoned: bool
    temperature: float
    max_tokens: int
    prompt_tokens: int = -1
    completion_tokens: int = -1
    text: str = ""
    error: str = ""


@dataclass
class Traffic:
    """The client's schedule: `workers` concurrent loops send healthy completions (greedy and
    sampled, short and long) for `duration` seconds; from `trigger_at` on, `poisoned` long
    requests carrying the rare word go out, one at a time, `poison_gap` seconds apart. The
    traffic lasts until every poisoned request was answered and `tail` seconds more, however
    slow the server was: a step the writer has not flushed yet (it flushes within a second,
    trace/writer.py) is lost to a kill, as in a real crash, and an incident must be older than
    that when the pod dies for its trace to hold it."""

    port: int
    duration: float
    trigger_at: float
    poisoned: int = 2
    poison_gap: float = 5.0
    workers: int = 3
    tail: float = 5.0
    sent: list[Sent] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _post(self, prompt: str, max_tokens: int, temperature: float, poisoned: bool) -> None:
        body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": temperature, "seed": len(self.sent)}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        s = Sent(time.time(), 0.0, prompt, poisoned, temperature, max_tokens)
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                a = json.loads(r.read())
            s.prompt_tokens = int(a["usage"]["prompt_tokens"])
            s.completion_tokens = int(a["usage"]["completion_tokens"])
            s.text = a["choices"][0]["text"]
        except (OSError, ValueError, KeyError) as e:
            s.error = f"{type(e).__name__}: {e}"
        s.t_done = time.time()
        with self._lock:
            self.sent.append(s)

    def _healthy(self, w: int, stop: threading.Event) -> None:
        texts = healthy_texts()
        i = w
        while not stop.is_set():
            p = texts[i % len(texts)]
            cut = len(p) if i % 3 == 0 else max(40, len(p) // (2 + i % 4))
            self._post(p[:cut], max_tokens=8 + 8 * (i % 5),
                       temperature=0.0 if i % 2 == 0 else 0.8, poisoned=False)
            i += self.workers

    def run(self, progress: Callable[[float, int], None] = lambda t, n: None) -> list[Sent]:
        t0 = time.time()
        stop = threading.Event()
        threads = [threading.Thread(target=self._healthy, args=(w, stop), daemon=True)
                   for w in range(self.workers)]
        for t in threads:
            t.start()
        k, last_done = 0, t0
        while True:
            now = time.time() - t0
            if k < self.poisoned and now >= self.trigger_at + k * self.poison_gap:
                self._post(poisoned_prompt(k), max_tokens=6, temperature=0.0, poisoned=True)
                k += 1
                last_done = time.time()
                continue
            if (k >= self.poisoned and now >= self.duration
                    and time.time() >= last_done + self.tail):
                break
            progress(now, len(self.sent))
            time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(timeout=320)
        return sorted(self.sent, key=lambda s: s.t_sent)
