"""Small torch models for capture tests (fresh per test)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Tiny(nn.Module):
    """embedding -> 3 blocks -> head; input_ids in, logits out."""

    def __init__(self, vocab: int = 16, d: int = 8, n: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d) for _ in range(n)])
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def ids(n: int = 4) -> torch.Tensor:
    return torch.arange(n).reshape(1, n) % 16


def greedy_tokens(model: nn.Module, path, steps: int, **kw) -> list[int]:
    """`steps` greedy tokens from ids 1-4, the whole sequence re-fed each step, under
    `qforensics.capture(model, path, **kw)`."""
    import qforensics

    seq = torch.tensor([[1, 2, 3, 4]])
    out = []
    with qforensics.capture(model, path, **kw), torch.no_grad():
        for _ in range(steps):
            logits = model(seq)
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], 1)
    return out


def assert_same_channels(a, b) -> tuple[int, int]:  # noqa: ANN001
    """Every record's token maxima and channel ranges in trace `a` equal to trace `b`'s (the
    same records, in the same order); returns how many token maxima and how many records
    with channel ranges were compared."""
    import numpy as np

    toks = chans = 0
    for (_, ra), (_, rb) in zip(a.records().iterrows(), b.records().iterrows()):
        ta, tb = a.token_absmax(ra), b.token_absmax(rb)
        assert (ta is None) == (tb is None)
        if tb is not None:
            np.testing.assert_array_equal(ta, tb)
            toks += len(tb)
        ca, cb = a.channel_ranges(ra), b.channel_ranges(rb)
        assert (ca is None) == (cb is None)
        if cb is not None:
            np.testing.assert_array_equal(ca[0], cb[0])
            np.testing.assert_array_equal(ca[1], cb[1])
            chans += 1
    return toks, chans
