"""Planted-bug kernels for --launcher tests (fixtures, never user kernels).

`awq_gemm_wrong_group` dequantizes AWQ-GEMM weights with the group of input row k computed as
k * n_groups // K instead of k // group_size: identical when K % group_size == 0, wrong rows
when it is not (the last, partial group steals rows from the ones before it).
"""

import numpy as np


def _unpack(words):
    order = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # column 8c + j lives in nibble order[j]
    w = words.astype(np.int64) & 0xFFFFFFFF
    return ((w[:, :, None] >> (4 * order)) & 0xF).reshape(w.shape[0], -1)


def awq_gemm_wrong_group(tensors, meta):
    q, z = _unpack(tensors["qweight"]), _unpack(tensors["qzeros"])
    s = tensors["scales"].astype(np.float64)
    k, n_groups = q.shape[0], s.shape[0]
    g = np.arange(k) * n_groups // k  # the planted bug
    w = (q - z[g]) * s[g]
    return (tensors["x"].astype(np.float64) @ w).astype(np.float32)


# float64 dequantization, float32 output: the float32 bound model covers it (replay/bounds.py)
awq_gemm_wrong_group.error_bound = "float32"
