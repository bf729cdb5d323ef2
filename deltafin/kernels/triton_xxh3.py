"""xxh3-64 (seed 0, default secret) of many byte buffers already on the GPU, in two launches.

Buffers are rows of a uint8 tensor [rows, stride] (a slab of expert files: each row one file), each with its
own length (over 240 bytes: shorter ones take XXH3's short paths, which the caller hashes on the host). The
decomposition is ``xxh3_ref``'s: ``_block_sums`` computes every 1,024-byte block's per-lane sums of every row
at once (the bulk of the bytes, read once at memory speed); ``_chain`` runs, one program per row, the
sequential scramble over those sums, adds the partial block and the last stripe, and stores the 8 lanes. The
host merges the 8 lanes of a row into its digest (``xxh3_ref.merge``, a few Python-int products a row): 64
bytes a buffer come back instead of 8, and no 128-bit product is needed on the device.

Legend: R rows hashed, NB a row's full blocks, G blocks per program, D block sums loaded per chain step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from deltafin.kernels import xxh3_ref as ref

G_BLOCKS = 4  # blocks per program of _block_sums: 4 KiB of a row
D_CHAIN = 16  # block sums loaded together by the chain: their load latency is paid once per 16 scrambles
_CONST: dict = {}  # device -> the secret's words as int64 tensors


@triton.jit
def _block_sums(words, row_words, rows, nblocks, nlast, secret, out, out_row, G: tl.constexpr):
    """Per-lane sums of G blocks of one row: grid (cdiv(max NB + 1, G), R). words: the rows as int64 words."""
    pb, r = tl.program_id(0), tl.program_id(1)
    row = tl.load(rows + r)
    nb = tl.load(nblocks + r)
    last = tl.load(nlast + r)
    s = tl.arange(0, 16 * G)  # [16 G] stripes of this program's blocks
    blk = pb * G + s // 16
    st = s % 16
    lane = tl.arange(0, 8)
    ok = ((blk < nb) | ((blk == nb) & (st < last)))[:, None]  # [16 G, 1]
    at = words + row * row_words + blk[:, None] * 128 + st[:, None] * 8  # [16 G, 1] pointers
    d = tl.load(at + lane[None, :], mask=ok, other=0).to(tl.uint64, bitcast=True)  # [16 G, 8]
    sw = tl.load(at + (lane ^ 1)[None, :], mask=ok, other=0).to(tl.uint64, bitcast=True)
    key = tl.load(secret + st[:, None] + lane[None, :]).to(tl.uint64, bitcast=True)  # secret word s + j
    dk = d ^ key
    term = tl.where(ok, (dk & 0xFFFFFFFF) * (dk >> 32) + sw, 0)
    sums = tl.sum(tl.reshape(term, [G, 16, 8]), axis=1)  # [G, 8]
    gb = pb * G + tl.arange(0, G)
    tl.store(out + r * out_row + gb[:, None] * 8 + lane[None, :], sums.to(tl.int64, bitcast=True),
             mask=(gb <= nb)[:, None])


@triton.jit
def _step(acc, b, key, n, nb):
    """One block of the chain: add its sums, scramble; a no-op past the row's full blocks."""
    a = acc + b
    a = ((a ^ (a >> 47)) ^ key) * 0x9E3779B1
    return tl.where(n < nb, a, acc)


@triton.jit
def _steps2(acc, t, key, n, nb):
    lo, hi = tl.split(t)  # t [8, 2]: blocks n, n + 1
    return _step(_step(acc, lo, key, n, nb), hi, key, n + 1, nb)


@triton.jit
def _steps4(acc, t, key, n, nb):
    lo, hi = tl.split(t)  # t [8, 2, 2]: the last dim is the high bit of the block's place
    return _steps2(_steps2(acc, lo, key, n, nb), hi, key, n + 2, nb)


@triton.jit
def _steps8(acc, t, key, n, nb):
    lo, hi = tl.split(t)
    return _steps4(_steps4(acc, lo, key, n, nb), hi, key, n + 4, nb)


@triton.jit
def _steps16(acc, t, key, n, nb):
    lo, hi = tl.split(t)
    return _steps8(_steps8(acc, lo, key, n, nb), hi, key, n + 8, nb)


@triton.jit
def _chain(data, row_bytes, rows, lengths, nblocks, sums, sums_row, init, key_scr, key_last, acc_out,
           D: tl.constexpr):
    """The 8 lanes of one row after all its bytes: grid (R,). data: the rows as uint8."""
    r = tl.program_id(0)
    row = tl.load(rows + r)
    n = tl.load(lengths + r)
    nb = tl.load(nblocks + r)
    lane = tl.arange(0, 8)
    acc = tl.load(init + lane).to(tl.uint64, bitcast=True)
    key = tl.load(key_scr + lane).to(tl.uint64, bitcast=True)
    base = sums + r * sums_row
    u = tl.arange(0, D)
    for c in range(0, tl.cdiv(nb, D)):
        blk = c * D + u
        t = tl.load(base + blk[:, None] * 8 + lane[None, :], mask=(blk < nb)[:, None], other=0)  # [D, 8]
        t = t.to(tl.uint64, bitcast=True)
        # [D, 8] -> [8, 2, .., 2], the block's place in binary with its high bit last, for tl.split's halves
        if D == 16:
            acc = _steps16(acc, tl.permute(tl.reshape(t, [2, 2, 2, 2, 8]), (4, 3, 2, 1, 0)), key, c * D, nb)
        else:
            tl.static_assert(D == 8, "chain loads of 8 or 16 block sums")
            acc = _steps8(acc, tl.permute(tl.reshape(t, [2, 2, 2, 8]), (3, 2, 1, 0)), key, c * D, nb)
    acc += tl.load(base + nb * 8 + lane).to(tl.uint64, bitcast=True)  # the partial block (zeros if none)
    # the last stripe: the row's last 64 bytes, unaligned, as little-endian words (and the lane-swapped ones)
    at = data + row * row_bytes + n - 64
    k = tl.arange(0, 8)
    shift = (k * 8).to(tl.uint64)[None, :]
    d = tl.sum(tl.load(at + lane[:, None] * 8 + k[None, :]).to(tl.uint64) << shift, axis=1)  # [8]
    sw = tl.sum(tl.load(at + (lane ^ 1)[:, None] * 8 + k[None, :]).to(tl.uint64) << shift, axis=1)
    dk = d ^ tl.load(key_last + lane).to(tl.uint64, bitcast=True)
    acc += (dk & 0xFFFFFFFF) * (dk >> 32) + sw
    tl.store(acc_out + r * 8 + lane, acc.to(tl.int64, bitcast=True))


def _as_i64(words: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(words.view(np.int64).copy()).to(device)


def _consts(device: torch.device) -> dict:
    if device not in _CONST:
        _CONST[device] = {"secret": _as_i64(ref.SECRET_WORDS, device),
                          "init": _as_i64(np.array(ref.ACC_INIT, dtype=np.uint64), device),
                          "scramble": _as_i64(ref.SCRAMBLE_KEY, device),
                          "last": _as_i64(ref.secret_words(ref.LAST_STRIPE_KEY), device)}
    return _CONST[device]


def lanes(data: torch.Tensor, rows: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The 8 final lanes (int64 [R, 8], on the device: nothing is waited for) of rows ``rows`` of ``data`` (uint8
    [N, stride], contiguous rows; stride and base 8-byte aligned), row i hashed over its first ``lengths[i]``
    bytes (each over 240 and at most stride). ``digests`` merges them."""
    N, S = data.shape
    assert data.dtype == torch.uint8 and data.stride(1) == 1 and data.stride(0) % 8 == 0
    assert data.data_ptr() % 8 == 0 and len(rows) == len(lengths) and rows
    assert all(ref.MIDSIZE_MAX < n <= S for n in lengths) and all(0 <= r < N for r in rows)
    dev = data.device
    R = len(rows)
    shapes = [ref.shape(n) for n in lengths]
    host = torch.tensor([list(rows), list(lengths), [b for b, _ in shapes], [s for _, s in shapes]],
                        dtype=torch.int64)
    meta = host.to(dev, non_blocking=True) if dev.type == "cuda" else host
    row_t, len_t, nb_t, last_t = meta
    top = max(b for b, _ in shapes) + 1  # blocks per row, the partial one included
    sums = torch.empty((R, top, 8), dtype=torch.int64, device=dev)
    words = data.view(torch.int64) if S % 8 == 0 else data.as_strided((N, S // 8 * 8), (data.stride(0), 1)).view(
        torch.int64)
    c = _consts(dev)
    _block_sums[(triton.cdiv(top, G_BLOCKS), R)](words, data.stride(0) // 8, row_t, nb_t, last_t, c["secret"],
                                                 sums, top * 8, G=G_BLOCKS)
    out = torch.empty((R, 8), dtype=torch.int64, device=dev)
    _chain[(R,)](data, data.stride(0), row_t, len_t, nb_t, sums, top * 8, c["init"], c["scramble"], c["last"], out,
                 D=D_CHAIN)
    return out


def digests(acc: torch.Tensor, lengths: Sequence[int]) -> list[int]:
    """The xxh3-64 digests (ints, as ``xxhash.xxh3_64_intdigest``) from ``lanes``'s result (one small
    device -> host read)."""
    host = acc.cpu().numpy().view(np.uint64)
    return [ref.merge(host[i], n) for i, n in enumerate(lengths)]


def xxh3_64_rows(data: torch.Tensor, rows: Sequence[int], lengths: Sequence[int]) -> list[int]:
    """``digests(lanes(...))``: the xxh3-64 of each listed row's first ``lengths[i]`` bytes."""
    return digests(lanes(data, rows, lengths), lengths)
