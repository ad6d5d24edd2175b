"""Snapshot fidelity: a GPTQ-packed layer too large to keep whole is tiled on the right axis, and
the real reader + bundle + rerun reproduce its output columns (capture, reader, bundle, kernel)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import qforensics
from qforensics.hooks import snapshots as snap_mod
from qforensics.replay.build import build_bundle_from_trace

K, N, G = 64, 48, 32


class QuantLinear(nn.Module):
    """A GPTQ v1 layer in the published layout: qweight [K/8, N] packed along K, qzeros
    [K/G, N/8] packed along N storing zero - 1, scales [K/G, N]."""

    def __init__(self, q: np.ndarray, z: np.ndarray, s: np.ndarray) -> None:
        super().__init__()
        qw = np.zeros((K // 8, N), np.int64)
        qz = np.zeros((K // G, N // 8), np.int64)
        for i in range(8):
            qw |= q[i::8] << (4 * i)
            qz |= (z[:, i::8] - 1) << (4 * i)
        self.register_buffer("qweight", torch.from_numpy(qw.astype(np.uint32).view(np.int32)))
        self.register_buffer("qzeros", torch.from_numpy(qz.astype(np.uint32).view(np.int32)))
        self.register_buffer("scales", torch.from_numpy(s))
        g = np.arange(K) // G
        self.w = torch.from_numpy(((q - z[g]) * s[g]).astype(np.float32))  # [K, N], this test's own dequant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def test_gptq_layer_tiled_on_the_output_axis_replays_its_columns(tmp_path, monkeypatch):
    rng = np.random.default_rng(7)
    q = rng.integers(0, 16, (K, N))
    z = rng.integers(1, 16, (K // G, N))
    s = (rng.random((K // G, N)) * 0.01 + 0.001).astype(np.float32)
    model = nn.Sequential(QuantLinear(q, z, s))
    monkeypatch.setattr(snap_mod, "WHOLE_LAYER_BYTES", 0)  # force the tile path
    x = torch.from_numpy(rng.standard_normal((1, 5, K)).astype(np.float32))
    x[0, 0, 3] = 2000.0  # an outlier: the first GEMM input past 448 is snapshotted
    with torch.no_grad(), qforensics.capture(model, tmp_path / "t.h5", snapshot_tile_rows=16):
        y = model(x)
    b = build_bundle_from_trace(tmp_path / "t.h5")
    assert b.meta["layout"] == "gptq" and b.meta["N_full"] == N and b.meta["K"] == K
    c0, c1 = b.meta["col_start"], b.meta["col_stop"]
    assert (c0, c1) == (0, 16) and b.meta["snapshot_kept"] == f"columns [0, 16) of {N}"
    np.testing.assert_allclose(b.reference, x.double().numpy().reshape(-1, K) @ model[0].w.double().numpy()[:, c0:c1],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b.observed, y.numpy().reshape(-1, N)[:, c0:c1], rtol=1e-5, atol=1e-3)
