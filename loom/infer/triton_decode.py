"""Split-KV decode attention over paged keys and values as Triton kernels (`paged_decode`), for `PagedKV` on a GPU.

Flash-decoding: one program per (request, key/value head, split). A split takes an even share of its request's
visible blocks (blocks 0..position // block_size) and reads their keys CHUNK positions at a time (64 on the
`tl.dot` path): each position's block id is gathered from the table and its key and value rows loaded from that
block, positions past the request's position or outside the split's blocks masked, so a step loads [CHUNK, d]
tiles whatever the block size (any, a power of two or not, smaller or larger than the chunk). It scores the
query heads of its key/value head against the chunk (`tl.dot`, queries padded to 16; a broadcast product for
heads under 16 wide), keeps a running max and sum in fp32 (online softmax) and writes its partial output and
log-sum-exp; a second kernel combines a request's splits by their log-sum-exp. When a (request, head) uses one
split, split 0 writes the output itself: no partials, and the combine kernel returns at once.

Shapes are static for a given `splits` (the grid is rows x kv_heads x splits) and the block table and positions
are read on the device, so the op runs inside a CUDA graph (`CompiledDecode`). How many of the `splits` a step
uses adapts to its rows on the device: with `programs` set, a step of many rows uses fewer splits (the others
write an empty log-sum-exp and stop; with one split used they stop at once), so a large batch does not pay for
partial outputs it does not need.

`paged_decode` is a `torch.library.triton_op` (torch.compile traces into its kernels); on a CPU it computes the
same thing in torch ops unless TRITON_INTERPRET=1 (the tests run the kernels through Triton's interpreter).
`paged_attention.reference_decode` is the float64 definition.
"""

from __future__ import annotations

import math
import os

import torch
from torch.library import wrap_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch wheels do not bring Triton: `available()` is False, PagedKV gathers instead
    triton = tl = None


def available() -> bool:
    return triton is not None


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def reference_paged_decode(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, table: torch.Tensor,
                           positions: torch.Tensor) -> torch.Tensor:
    """What `paged_decode` computes, in torch ops (fp32 softmax): the table's blocks gathered densely and
    masked by position. The CPU path without the interpreter."""
    rows, kv_heads, queries, d = q.shape
    size = K.shape[2]
    keys = K[table].transpose(1, 2).flatten(2, 3).float()  # [rows, kv, blocks x size, d]
    values = V[table].transpose(1, 2).flatten(2, 3).float()
    scores = torch.matmul(q.float(), keys.transpose(-1, -2)) * (1.0 / math.sqrt(d))
    seen = torch.arange(table.shape[1] * size, device=q.device) <= positions.reshape(rows, 1)
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), values).to(q.dtype)


if triton is not None:

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, out_ptr, part_ptr, lse_ptr,
                      n_rows, n_heads, G, D, scale,
                      sq_r, sq_h, sq_g, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
                      st_r, st_c, sp_r, so_r, so_h, so_g, so_d,
                      SPLITS: tl.constexpr, PROGRAMS: tl.constexpr, BS: tl.constexpr, CHUNK: tl.constexpr,
                      GP: tl.constexpr, DP: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
                      UPCAST: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        split = tl.program_id(2)
        used = SPLITS
        if PROGRAMS > 0:  # many rows: fewer splits each (at least one); the grid stays rows x heads x SPLITS
            used = tl.minimum(tl.maximum(PROGRAMS // (n_rows * n_heads), 1), SPLITS)
            if (used == 1) & (split > 0):  # split 0 reads the whole row and writes `out` itself
                return
        pos = tl.load(pos_ptr + row * sp_r).to(tl.int32)
        visible = pos // BS + 1  # blocks holding keys 0..pos
        per = (visible + used - 1) // used
        lo = split * per
        hi = tl.minimum(lo + per, visible)
        end = tl.minimum(hi * BS, pos + 1)  # this split's keys: positions lo * BS .. end - 1 (none if lo >= hi)

        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        c = tl.arange(0, CHUNK)
        gm = g < G
        dm = d < D
        q = tl.load(q_ptr + row * sq_r + head * sq_h + g[:, None] * sq_g + d[None, :] * sq_d,
                    mask=gm[:, None] & dm[None, :], other=0.0)
        q = q.to(k_ptr.dtype.element_ty)
        top = tl.full([GP], float("-inf"), tl.float32)
        mass = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        row_table = table_ptr + row * st_r
        k_head = k_ptr + head * sk_h + d[None, :] * sk_d
        v_head = v_ptr + head * sv_h + d[None, :] * sv_d
        for start in range(lo * BS, end, CHUNK):  # CHUNK positions at a time, each gathered through the table
            p = start + c
            seen = p < end
            blk = tl.load(row_table + (p // BS) * st_c, mask=seen, other=0).to(tl.int64)  # [CHUNK] block ids
            slot = (p % BS)[:, None]
            kv_mask = seen[:, None] & dm[None, :]
            k = tl.load(k_head + blk[:, None] * sk_b + slot * sk_s, mask=kv_mask, other=0.0)  # [CHUNK, DP]
            v = tl.load(v_head + blk[:, None] * sv_b + slot * sv_s, mask=kv_mask, other=0.0)
            if USE_DOT:
                if UPCAST:  # Triton's interpreter multiplies bf16 as integers: its dot gets fp32 copies
                    s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            else:
                s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], 2)
            s = tl.where(seen[None, :], (s * scale).to(tl.float32), float("-inf"))  # scale: log2(e)/sqrt(d); fp32 (a
            # compiled caller may hand the scalar in as fp64, which would widen the loop-carried maximum)
            new_top = tl.maximum(top, tl.max(s, 1))  # finite: position `start` is visible
            alpha = tl.exp2(top - new_top)
            w = tl.exp2(s - new_top[:, None])
            mass = mass * alpha + tl.sum(w, 1)
            if USE_DOT:
                if UPCAST:
                    pv = tl.dot(w.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
                else:
                    pv = tl.dot(w.to(v.dtype), v, input_precision=PRECISION)
                acc = acc * alpha[:, None] + pv
            else:
                acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * v.to(tl.float32)[None, :, :], 1)
            top = new_top

        some = mass > 0.0  # an empty split (past the row's blocks) has mass 0
        result = acc / tl.where(some, mass, 1.0)[:, None]
        out_at = out_ptr + row * so_r + head * so_h + g[:, None] * so_g + d[None, :] * so_d
        if SPLITS == 1:
            tl.store(out_at, result.to(out_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])
        elif used == 1:  # one split at run time (only split 0 gets here): no partials, no combine
            tl.store(out_at, result.to(out_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])
        else:
            # partials [rows, heads, SPLITS, G, D] and lse [rows, heads, SPLITS, G], contiguous (log2 units)
            at = (row * n_heads + head) * SPLITS + split
            lse = tl.where(some, top + tl.log2(tl.where(some, mass, 1.0)), float("-inf"))
            tl.store(lse_ptr + at * G + g, lse, mask=gm)
            tl.store(part_ptr + (at * G + g[:, None]) * D + d[None, :], result,
                     mask=(gm & some)[:, None] & dm[None, :])

    @triton.jit
    def _combine_kernel(part_ptr, lse_ptr, out_ptr, n_rows, n_heads, G, D, so_r, so_h, so_g, so_d,
                        SPLITS: tl.constexpr, PROGRAMS: tl.constexpr, SP: tl.constexpr, GP: tl.constexpr,
                        DP: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        if PROGRAMS > 0:  # the split kernel's count: with one split used it wrote `out` itself
            used = tl.minimum(tl.maximum(PROGRAMS // (n_rows * n_heads), 1), SPLITS)
            if used == 1:
                return
        s = tl.arange(0, SP)[:, None]
        g = tl.arange(0, GP)[None, :]
        d = tl.arange(0, DP)[None, None, :]
        at = ((row * n_heads + head) * SPLITS + s) * G + g  # [SP, GP]
        lse = tl.load(lse_ptr + at, mask=(s < SPLITS) & (g < G), other=float("-inf"))
        top = tl.max(lse, 0)  # [GP]: finite for a real query (split 0 holds block 0), -inf for padding
        top = tl.where(top > float("-inf"), top, 0.0)
        w = tl.exp2(lse - top[None, :])  # 0 for empty splits
        filled = (lse > float("-inf"))[:, :, None] & (d < D)
        part = tl.load(part_ptr + at[:, :, None] * D + d, mask=filled, other=0.0)  # [SP, GP, DP]
        mass = tl.sum(w, 0)
        out = tl.sum(part * w[:, :, None], 0) / tl.where(mass > 0.0, mass, 1.0)[:, None]  # [GP, DP]
        gg = tl.arange(0, GP)[:, None]
        dd = tl.arange(0, DP)[None, :]
        tl.store(out_ptr + row * so_r + head * so_h + gg * so_g + dd * so_d, out.to(out_ptr.dtype.element_ty),
                 mask=(gg < G) & (dd < D))

    @torch.library.triton_op("loom::paged_decode", mutates_args=())
    def _paged_decode_op(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, table: torch.Tensor,
                         positions: torch.Tensor, splits: int, programs: int) -> torch.Tensor:
        rows, heads, G, D = q.shape
        if q.device.type == "cpu" and not _interpreted():
            return reference_paged_decode(q, K, V, table, positions)
        out = torch.empty_like(q)
        size = K.shape[2]
        dp = _pow2(D)
        use_dot = dp >= 16  # tl.dot wants 16 or more in each dimension: the chunk is, queries are padded to 16
        chunk = 64 if use_dot else 16  # key positions per step (any block size: each is gathered by its block)
        gp = max(16, _pow2(G)) if use_dot else _pow2(G)
        precision = "ieee" if K.dtype == torch.float32 else "tf32"  # fp32 caches: exact products, not TF32
        if splits > 1:
            part = torch.empty(rows, heads, splits, G, D, dtype=torch.float32, device=q.device)
            lse = torch.empty(rows, heads, splits, G, dtype=torch.float32, device=q.device)
        else:  # written straight to `out`: placeholders (distinct tensors, so no argument aliases another)
            part, lse = (torch.empty(1, dtype=torch.float32, device=q.device) for _ in range(2))
        scale = 1.4426950408889634 / math.sqrt(D)  # log2(e) / sqrt(d): softmax in base 2
        wrap_triton(_split_kernel)[(rows, heads, splits)](
            q, K, V, table, positions, out, part, lse, rows, heads, G, D, scale,
            q.stride(0), q.stride(1), q.stride(2), q.stride(3), K.stride(0), K.stride(1), K.stride(2), K.stride(3),
            V.stride(0), V.stride(1), V.stride(2), V.stride(3), table.stride(0), table.stride(1), positions.stride(0),
            out.stride(0), out.stride(1), out.stride(2), out.stride(3),
            SPLITS=splits, PROGRAMS=programs, BS=size, CHUNK=chunk, GP=gp, DP=dp, USE_DOT=use_dot,
            PRECISION=precision, UPCAST=_interpreted() and K.dtype != torch.float32)
        if splits > 1:
            wrap_triton(_combine_kernel)[(rows, heads)](
                part, lse, out, rows, heads, G, D, out.stride(0), out.stride(1), out.stride(2), out.stride(3),
                SPLITS=splits, PROGRAMS=programs, SP=_pow2(splits), GP=_pow2(G), DP=dp)
        return out


def paged_decode(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, table: torch.Tensor, positions: torch.Tensor,
                 splits: int, programs: int = 0) -> torch.Tensor:
    """Decode attention of one token per request over paged keys and values.

    q [rows, kv_heads, G, d]: the G query heads of each key/value head folded, one token each; K, V the pool
    [blocks, kv_heads, block_size, d]; table [rows, max_blocks] block ids (int32 or int64, on q's device);
    positions [rows] (request b sees keys 0..positions[b], stored in its blocks table[b, 0..]). `splits`: a Python
    int, the programs per (request, head) (fixed per compiled bucket); `programs` > 0 lets a step of many rows
    use fewer of them (about `programs` programs in all, at least one split per row). -> [rows, kv_heads, G, d]
    in q's dtype, softmax in fp32."""
    if triton is None:
        return reference_paged_decode(q, K, V, table, positions.reshape(-1))
    return _paged_decode_op(q, K, V, table, positions.reshape(-1), int(splits), int(programs))


def splits_for(max_blocks: int, device: torch.device) -> tuple[int, int]:
    """(splits, programs) for `paged_decode` on `device` with block tables `max_blocks` wide: up to 16 splits
    (never more than the blocks), and about four programs per multiprocessor, so a batch of one request spreads its
    keys over the GPU and a large batch uses one split per row and head."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return max(1, min(16, max_blocks)), 4 * sms
