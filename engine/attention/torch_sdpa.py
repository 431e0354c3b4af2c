"""The ``torch`` backend: PyTorch's ``scaled_dot_product_attention`` over gathered blocks.

The reference path, and the one every device can run. Decode rows (one query
token) are sorted by context length into buckets; each bucket is one SDPA call
over its sequences' blocks gathered into a padded ``[B, Hkv, L, D]`` view
(bucketing keeps the padding small when lengths are ragged). On a CPU a bucket
holds at most ``CPU_DECODE_BUCKET_ROWS`` rows, so its gathered K/V (a few MB) is
still in cache when SDPA reads it; on a GPU there are at most
``DECODE_MAX_BUCKETS``. Query heads that share a KV head are folded into the
query axis (``[B, Hkv, G, D]``), so GQA never copies K/V per query head.
Prefill chunks (``q_len > 1``) run one call each: ``is_causal`` without a cached
prefix, else a causal mask offset by the prefix length.

A layer with a sliding window (Gemma's local layers) masks, in the same gathered
blocks, the keys before each row's window too (its masks are made on the first such
layer of a step and kept in the plan for the others). Soft-capped scores (Gemma 2) are
computed in plain ops instead of SDPA, which has no soft-capping: the scores in fp32,
``softcap * tanh(s / softcap)``, the mask, the softmax, then the values, for at most
``SOFTCAP_ROWS`` query rows at a time.

A pool in a narrower dtype than the queries (fp16 K/V under fp32 compute) is read
back into the queries' dtype after each gather; a chunk without a cached prefix
attends to its own K/V rounded the same way, so every row sees the values the pool
holds, whichever path reads them.

The plans are built on the host once per step (:meth:`TorchBackend.plan`); the
gather buffers come from a grow-only :class:`AttentionScratch` kept across steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from tokenrelay.engine.attention.backend import AttentionBackend, HostBatch
from tokenrelay.engine.attention.metadata import AttentionMetadata

DECODE_BUCKET_MIN = 8  # at least this many rows per decode bucket
DECODE_MAX_BUCKETS = 4
# CPU: rows per decode bucket. 8 rows x ~500 tokens of K and V is ~5 MB, which stays in
# cache between the gather and SDPA; one bucket of 64 rows goes out to memory and back
# (python -m bench.engine_profile attention; docs/benchmarks.md, "Engine profile").
CPU_DECODE_BUCKET_ROWS = 8
# soft-capped attention (no SDPA): query rows whose fp32 scores are held at once
SOFTCAP_ROWS = 256


class AttentionScratch:
    """A grow-only flat buffer for the decode gathers, reused across layers and steps."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of ``numel`` elements (contents undefined)."""
        buf = self._buf
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            size = max(numel, int(buf.numel() * 1.25) if buf is not None else 0)
            buf = self._buf = torch.empty(size, dtype=dtype, device=device)
        return buf[:numel]


@dataclass
class DecodePlan:
    """One bucket of rows with a single query token."""

    token_idx: torch.Tensor  # [Bd] int64 rows of the flat batch
    blocks: torch.Tensor  # [Bd * nb] int64 block ids to gather (padded with block 0)
    num_seqs: int
    blocks_per_seq: int  # nb
    mask: torch.Tensor  # [Bd, 1, 1, nb * block_size] additive (0 / -inf)
    identity: bool = False  # token_idx == arange(T): the whole batch, in order
    ctx: torch.Tensor | None = None  # [Bd] each row's context length (for a window's mask)


@dataclass
class PrefillPlan:
    """One sequence computing a chunk of ``q_len > 1`` tokens."""

    start: int  # rows [start, end) of the flat batch
    end: int
    start_pos: int  # tokens already cached before this chunk
    blocks: torch.Tensor | None  # [nb] int64 blocks holding the context; None: no prefix
    mask: torch.Tensor | None  # [q_len, ctx] additive causal mask offset by start_pos


@dataclass
class TorchPlan:
    """The torch backend's plan of one step."""

    decode: list[DecodePlan] = field(default_factory=list)
    prefills: list[PrefillPlan] = field(default_factory=list)
    kernel_batch: object | None = None  # the CPU kernel's decode rows (cpu backend)
    # the masks of windowed or soft-capped layers, by (bucket or chunk, window)
    masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """SDPA of ``q`` ``[B, Hq, n, D]`` over ``k``/``v`` ``[B, Hk, L, D]`` (``Hq`` a multiple
    of ``Hk``) under the additive ``mask``; with ``softcap``, the same in plain ops with
    each score soft-capped before the mask (as transformers' eager Gemma 2 attention)."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    kt = k.float().transpose(-1, -2)
    out = q.new_empty(q.shape)
    for i in range(0, q.shape[2], SOFTCAP_ROWS):  # [B, Hq, rows, L] fp32 scores at a time
        rows = slice(i, i + SOFTCAP_ROWS)
        scores = torch.matmul(q[:, :, rows].float(), kt) * scale
        scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:  # [n, L] (a chunk) or [B, 1, 1, L] (decode rows)
            scores = scores + mask[..., rows, :]
        out[:, :, rows] = torch.matmul(scores.softmax(-1).to(q.dtype), v)
    return out


def causal_mask(
    n: int, start: int, window: int | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The additive ``[n, start + n]`` mask of rows at positions ``start ..`` over keys
    ``0 ..``: a key after its row, or ``window`` or more before it, is ``-inf``."""
    rows = torch.arange(start, start + n, device=device)[:, None]
    cols = torch.arange(start + n, device=device)[None, :]
    hidden = cols > rows
    if window is not None:
        hidden |= cols <= rows - window
    mask = torch.zeros((n, start + n), device=device, dtype=dtype)
    return mask.masked_fill_(hidden, float("-inf"))


class TorchBackend(AttentionBackend):
    """SDPA over gathered blocks, planned on the host once per step."""

    name = "torch"
    needs_plan = True

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self.scratch = AttentionScratch()

    def plan(self, meta: AttentionMetadata, host: HostBatch) -> None:
        plan = TorchPlan()
        meta.plan = plan
        self._plan_decode(meta, plan, host)
        self._plan_prefill(meta, plan, host)

    def _plan_decode(self, meta: AttentionMetadata, plan: TorchPlan, host: HostBatch) -> None:
        """Bucket single-token rows by context length (sorted, equal-sized buckets)."""
        rows = np.nonzero(host.q_lens == 1)[0]
        if not len(rows):
            return
        ctx, cu_q, device = host.ctx, host.cu_q, self.device
        rows = rows[np.argsort(ctx[rows], kind="stable")]
        if device.type == "cpu":
            buckets = -(-len(rows) // CPU_DECODE_BUCKET_ROWS)
        else:
            buckets = max(1, min(DECODE_MAX_BUCKETS, len(rows) // DECODE_BUCKET_MIN))
        bs = meta.block_size
        for part in np.array_split(rows, buckets):
            d_ctx = ctx[part]
            nb = int(-(-d_ctx.max() // bs))
            mask = np.where(np.arange(nb * bs)[None, :] < d_ctx[:, None], 0.0, -np.inf)
            token_idx = cu_q[part]
            blocks = np.ascontiguousarray(host.block_tables[part, :nb]).ravel()
            plan.decode.append(
                DecodePlan(
                    token_idx=torch.from_numpy(token_idx).to(device),
                    blocks=torch.from_numpy(blocks).to(device),
                    num_seqs=len(part),
                    blocks_per_seq=nb,
                    mask=torch.from_numpy(mask).to(device=device, dtype=self.dtype)[
                        :, None, None, :
                    ],
                    identity=len(part) == len(cu_q) - 1
                    and bool((token_idx == np.arange(len(part))).all()),
                    ctx=torch.from_numpy(d_ctx).to(device),
                )
            )

    def _plan_prefill(self, meta: AttentionMetadata, plan: TorchPlan, host: HostBatch) -> None:
        bs, device = meta.block_size, self.device
        for i in np.nonzero(host.q_lens > 1)[0]:
            n, start, c = int(host.q_lens[i]), int(host.starts[i]), int(host.ctx[i])
            blocks = mask = None
            if start > 0:  # attend to the cached prefix too: bottom-right aligned causal mask
                mask = causal_mask(n, start, None, self.dtype, device)
                blocks = torch.from_numpy(host.block_tables[i, : -(-c // bs)].copy()).to(device)
            plan.prefills.append(
                PrefillPlan(int(host.cu_q[i]), int(host.cu_q[i + 1]), start, blocks, mask)
            )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        plan = meta.plan
        if not isinstance(plan, TorchPlan):
            raise RuntimeError(f"{self.name} attention: the step was built without its plan")
        if len(plan.decode) == 1 and plan.decode[0].identity and plan.kernel_batch is None:
            return self._decode(q, k_cache, v_cache, plan, 0, scale, window, softcap)
        out = q.new_empty(q.shape)
        self._decode_rows(q, out, k_cache, v_cache, plan, scale, window, softcap)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        for i, p in enumerate(plan.prefills):
            if p.blocks is None:  # no cached prefix: this chunk's own K/V is the whole context
                kp, vp = k[p.start : p.end], v[p.start : p.end]
                if k_cache.dtype != q.dtype:  # as the pool holds them
                    kp, vp = kp.to(k_cache.dtype), vp.to(v_cache.dtype)
            else:
                assert p.mask is not None
                ctx = p.mask.shape[1]
                kp = k_cache.index_select(0, p.blocks).view(-1, num_kv_heads, head_dim)[:ctx]
                vp = v_cache.index_select(0, p.blocks).view(-1, num_kv_heads, head_dim)[:ctx]
            kp, vp = kp.to(q.dtype), vp.to(q.dtype)  # no copy where the dtypes agree
            qp = q[p.start : p.end].transpose(0, 1)[None]  # [1, H, n, D]
            kp, vp = kp.transpose(0, 1)[None], vp.transpose(0, 1)[None]  # [1, Hkv, ctx, D]
            if window is None and softcap is None:
                o = F.scaled_dot_product_attention(
                    qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=scale,
                    enable_gqa=True,
                )  # fmt: skip
            else:  # the masks of a window or a cap, made by this step's first such layer
                key = (-1 - i, window)
                if key not in plan.masks:
                    n = p.end - p.start
                    plan.masks[key] = causal_mask(n, p.start_pos, window, q.dtype, q.device)
                o = attend(qp, kp, vp, plan.masks[key], scale, softcap)
            out[p.start : p.end] = o[0].transpose(0, 1)
        return out

    def _decode_rows(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: TorchPlan,
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> None:
        """Every single-token row of the step into ``out`` (the cpu backend overrides this)."""
        for i, bucket in enumerate(plan.decode):
            qd = q.index_select(0, bucket.token_idx)
            o = self._decode(qd, k_cache, v_cache, plan, i, scale, window, softcap)
            out.index_copy_(0, bucket.token_idx, o)

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        step: TorchPlan,
        index: int,
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """One SDPA call for bucket ``index`` of single-token rows: ``q`` ``[Bd, H, D]`` ->
        same."""
        plan = step.decode[index]
        num_seqs, num_heads, head_dim = q.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        groups = num_heads // num_kv_heads
        shape = (plan.blocks.shape[0], block_size, num_kv_heads, head_dim)
        numel = shape[0] * block_size * num_kv_heads * head_dim
        flat = self.scratch.take(2 * numel, k_cache.dtype, k_cache.device)
        k_buf, v_buf = flat[:numel].view(shape), flat[numel:].view(shape)
        torch.index_select(k_cache, 0, plan.blocks, out=k_buf)
        torch.index_select(v_cache, 0, plan.blocks, out=v_buf)
        length = plan.blocks_per_seq * block_size
        # [Bd, Hkv, L, D]; the G query heads of a KV head as rows of the query
        kd = k_buf.view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        vd = v_buf.view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        qd = q.view(num_seqs, num_kv_heads, groups, head_dim)
        mask = plan.mask
        if window is not None:  # also hide the keys before each row's window
            if (index, window) not in step.masks:
                assert plan.ctx is not None
                cols = torch.arange(length, device=q.device)
                old = cols[None, :] < (plan.ctx[:, None] - window)  # [Bd, L]
                step.masks[(index, window)] = mask.masked_fill(old[:, None, None, :], -torch.inf)
            mask = step.masks[(index, window)]
        o = attend(qd, kd, vd, mask, scale, softcap)
        return o.reshape(num_seqs, num_heads, head_dim)
