"""The GGUF block formats the CPU quant kernels multiply, and their dequantization in torch.

The 32-weight formats of :data:`QTYPES` (ggml blocks, little endian; ``q`` the quants,
``d`` the scale, ``m`` the offset, both fp16):

* ``Q4_0``: 18 bytes a block, ``d`` and 16 bytes of nibbles;
  ``w[j] = ((q[j] & 15) - 8) d``, ``w[j + 16] = ((q[j] >> 4) - 8) d`` (``j < 16``).
* ``Q4_1``: 20 bytes, ``d``, ``m``, 16 bytes; ``w[j] = (q[j] & 15) d + m``, ...
* ``Q5_0``: 22 bytes, ``d``, a uint32 ``qh``, 16 bytes of nibbles; weight ``j``'s 5-bit
  quant ``q5[j]`` is its nibble (as Q4_0's) with bit ``j`` of ``qh`` as its fifth bit;
  ``w[j] = (q5[j] - 16) d``.
* ``Q5_1``: 24 bytes, ``d``, ``m``, ``qh``, 16 bytes; ``w[j] = q5[j] d + m``.
* ``Q8_0``: 34 bytes, ``d``, 32 int8 ``q``; ``w[j] = q[j] d``.

The K-quants of :data:`KQTYPES` are super-blocks of 256 weights (``Q4_K`` 144 bytes,
``Q5_K`` 176, ``Q6_K`` 210; ``csrc/kquant.c`` documents them).
"""

from __future__ import annotations

import torch

BLOCK = 32  # weights per block of the QTYPES
KBLOCK = 256  # weights per super-block of the KQTYPES
# name -> (ggml type id, bytes per block of 32 weights)
QTYPES: dict[str, tuple[int, int]] = {
    "Q4_0": (2, 18),
    "Q4_1": (3, 20),
    "Q5_0": (6, 22),
    "Q5_1": (7, 24),
    "Q8_0": (8, 34),
}
# name -> (ggml type id, bytes per super-block of 256 weights)
KQTYPES: dict[str, tuple[int, int]] = {"Q4_K": (12, 144), "Q5_K": (13, 176), "Q6_K": (14, 210)}


def dequantize_blocks(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """uint8 blocks ``[N, K / block * bytes]`` -> fp32 ``[N, K]`` without the kernel.

    The 32-weight formats with torch ops; the K-quants with gguf-py's numpy reference.
    """
    if qtype in KQTYPES:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        raw = blocks.contiguous().numpy()
        return torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]).astype("float32"))
    _, size = QTYPES[qtype]
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, size)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [N, nb, 1]
    if qtype == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(n, -1)
    nibbles = b[..., -16:]
    q = torch.cat((nibbles & 15, nibbles >> 4), dim=-1).float()  # [N, nb, 32]
    if qtype in ("Q5_0", "Q5_1"):
        qh = b[..., size - 20 : size - 16]  # [N, nb, 4]: bit i of byte i // 8 is weight i's
        bits = qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8) & 1  # [N, nb, 4, 8]
        q = q + 16.0 * bits.reshape(*q.shape).float()
    if qtype in ("Q4_1", "Q5_1"):
        m = b[..., 2:4].contiguous().view(torch.float16).float()
        return torch.addcmul(m, q, d).reshape(n, -1)
    return ((q - (16.0 if qtype == "Q5_0" else 8.0)) * d).reshape(n, -1)
