"""xxh3-64 (seed 0, default secret) of long inputs, in the form the GPU kernel computes it, in plain numpy.

XXH3's long path (inputs over 240 bytes; xxHash spec, "XXH3 long inputs") keeps 8 uint64 accumulators. Each
64-byte stripe adds, per lane j, ``d[j ^ 1] + lo32(d[j] ^ k[j]) * hi32(d[j] ^ k[j])`` (d the stripe's 8 words,
k the secret's words from 8 bytes further per stripe); 16 stripes (1,024 bytes) make a block, after which every
lane is scrambled. Within a block the adds commute, so every block's sums can be computed at once over the whole
input (``block_sums``); only the chain of scrambles over the block sums is sequential (``chain``), then the last
partial block, the last stripe (read from the end) and the merge of the 8 lanes (``merge``). ``digest`` is that
decomposition end to end: the reference the Triton kernel (``triton_xxh3``) is tested against, itself tested
against ``xxhash.xxh3_64_intdigest``.
"""

from __future__ import annotations

import numpy as np

M64 = (1 << 64) - 1
P32_1, P32_2, P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
P64_1, P64_2, P64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
P64_4, P64_5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
PRIME_MX1 = 0x165667919E3779F9
STRIPE = 64
SECRET_SIZE = 192
STRIPES_PER_BLOCK = (SECRET_SIZE - STRIPE) // 8  # 16
BLOCK = STRIPE * STRIPES_PER_BLOCK  # 1024
MIDSIZE_MAX = 240  # at most this many bytes take XXH3's short paths (hashed on the host)
LAST_STRIPE_KEY = SECRET_SIZE - STRIPE - 7  # byte offset of the last stripe's secret (XXH_SECRET_LASTACC_START)
MERGE_KEY = 11  # byte offset of the merge's secret (XXH_SECRET_MERGEACCS_START)
# XXH3's default secret (kSecret), 192 bytes
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
ACC_INIT = (P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1)


def secret_words(offset: int, n: int = 8) -> np.ndarray:
    """n little-endian uint64 words of the secret from byte ``offset`` (any offset, aligned or not)."""
    return np.frombuffer(SECRET[offset : offset + 8 * n], dtype="<u8").astype(np.uint64)


SCRAMBLE_KEY = secret_words(SECRET_SIZE - STRIPE)  # [8]: the scramble's secret, its last 64 bytes
SECRET_WORDS = secret_words(0, SECRET_SIZE // 8)  # [24]: stripe s, lane j takes word s + j


def shape(n: int) -> tuple[int, int]:
    """(full blocks, stripes of the last partial block) of an n-byte long input (n > 240): every block but the
    one that holds the last byte is scrambled; that one's stripes before the last stripe are added plainly."""
    assert n > MIDSIZE_MAX, "xxh3's long path is for inputs over 240 bytes"
    blocks = (n - 1) // BLOCK
    return blocks, ((n - 1) - BLOCK * blocks) // STRIPE


def _terms(d: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Each stripe's adds to the 8 lanes: d, keys [..., 8] uint64 -> [..., 8]."""
    dk = d ^ keys
    return (dk & np.uint64(0xFFFFFFFF)) * (dk >> np.uint64(32)) + d[..., [1, 0, 3, 2, 5, 4, 7, 6]]


def block_sums(buf: np.ndarray) -> np.ndarray:
    """[blocks + 1, 8] uint64: each full block's per-lane sum, then the last partial block's (zeros when it has no
    stripe before the last stripe). buf: uint8 [n], n > 240."""
    n = buf.size
    blocks, last = shape(n)
    keys = np.stack([SECRET_WORDS[s : s + 8] for s in range(STRIPES_PER_BLOCK)])  # [16, 8]
    words = buf[: blocks * BLOCK].view("<u8").astype(np.uint64).reshape(blocks, STRIPES_PER_BLOCK, 8)
    out = np.zeros((blocks + 1, 8), dtype=np.uint64)
    with np.errstate(over="ignore"):
        out[:blocks] = _terms(words, keys).sum(axis=1, dtype=np.uint64)
        tail = buf[blocks * BLOCK : blocks * BLOCK + last * STRIPE].view("<u8").astype(np.uint64).reshape(last, 8)
        out[blocks] = _terms(tail, keys[:last]).sum(axis=0, dtype=np.uint64)
    return out


def scramble(acc: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return ((acc ^ (acc >> np.uint64(47))) ^ SCRAMBLE_KEY) * np.uint64(P32_1)


def last_stripe(buf: np.ndarray) -> np.ndarray:
    """[8] uint64: the adds of the input's last 64 bytes (read from the end, unaligned) with their own secret."""
    d = np.frombuffer(buf[-STRIPE:].tobytes(), dtype="<u8").astype(np.uint64)
    with np.errstate(over="ignore"):
        return _terms(d, secret_words(LAST_STRIPE_KEY))


def chain(sums: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """The 8 lanes after every block: the scramble chain over the full blocks' sums (sums [blocks + 1, 8]), then
    the partial block's sum and the last stripe's adds (tail [8])."""
    acc = np.array(ACC_INIT, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for b in sums[:-1]:
            acc = scramble(acc + b)
        return acc + sums[-1] + tail


def avalanche(h: int) -> int:
    h ^= h >> 37
    h = (h * PRIME_MX1) & M64
    return h ^ (h >> 32)


def merge(acc, n: int) -> int:
    """The 64-bit digest from the 8 final lanes (Python ints or uint64s) of an n-byte input: each pair of lanes,
    keyed, folds its 128-bit product (low ^ high) into a sum that starts at n * P64_1, then the avalanche."""
    key = [int(k) for k in secret_words(MERGE_KEY)]
    a = [int(x) for x in acc]
    h = (n * P64_1) & M64
    for i in range(4):
        p = (a[2 * i] ^ key[2 * i]) * (a[2 * i + 1] ^ key[2 * i + 1])
        h = (h + ((p & M64) ^ (p >> 64))) & M64
    return avalanche(h)


def digest(data) -> int:
    """xxh3-64 of ``data`` (bytes-like or uint8 array, over 240 bytes) through the decomposition above; equals
    ``xxhash.xxh3_64_intdigest(data)``."""
    buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
    return merge(chain(block_sums(buf), last_stripe(buf)), buf.size)
