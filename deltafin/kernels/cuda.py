"""Where the model code meets the CUDA kernels: which calls take the Triton path, and the grouped MoE step.

The fast path runs for bf16 activations on a CUDA device (the default compute dtype there); float32
activations keep the plain torch path, the exact reference. ``DELTAFIN_KERNELS=torch`` turns the Triton
path off (for comparisons); ``DELTAFIN_KERNELS=interpret`` with ``TRITON_INTERPRET=1`` runs it on CPU tensors
through Triton's interpreter (tests of the wiring on machines without a GPU).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger(__name__)
LINEAR_FORMATS = ("mxfp4", "int8", "int4g32")
_ROLES = ("gate", "up", "down")
# kernels used so far in this process, for the run's stats line
USED: set[str] = set()
_BROKEN: set[str] = set()  # small fused kernels that failed to build here: their torch forms run for the process


def enabled(x: torch.Tensor) -> bool:
    if x.dtype != torch.bfloat16:  # first: the CPU's float32 fast path asks this per op, the environment is slower
        return False
    return kernel_device(x.device)


def kernel_device(device: torch.device) -> bool:
    """Whether the Triton kernels run for tensors on ``device``: CUDA, or any device under the interpreter
    (DELTAFIN_KERNELS=interpret with TRITON_INTERPRET=1); never with DELTAFIN_KERNELS=torch."""
    mode = os.environ.get("DELTAFIN_KERNELS", "triton")
    on_device = device.type == "cuda" or (mode == "interpret" and os.environ.get("TRITON_INTERPRET") == "1")
    return on_device and mode != "torch"


def linear(x: torch.Tensor, w) -> torch.Tensor | None:
    """x @ W^T through a Triton kernel, or None where the plain torch path applies."""
    if not enabled(x) or getattr(w, "format", None) not in LINEAR_FORMATS or len(w.shape) != 2:
        return None
    from deltafin.kernels import triton as K

    USED.add(f"triton:{w.format}_linear")
    if w.format == "mxfp4":
        return K.mxfp4_linear(x, w.data, w.scale)
    if w.format == "int8":
        return K.int8_linear(x, w.data, w.scale)
    return K.int4g32_linear(x, w.data, w.scale)


def mla_absorb_q(q_nope: torch.Tensor, w) -> torch.Tensor | None:
    """One token's q_nope [1, H, dn] times each head's W_uk of an int8 or bf16 kv_b_proj record
    (``triton_decode``), or None (the torch form runs)."""
    return _absorbed("mla_absorb_q", q_nope, w, q_nope.shape[-1])


def mla_absorb_out(o: torch.Tensor, w, dn: int) -> torch.Tensor | None:
    """One token's attention output over the latent o [1, H, R] times each head's W_uv, or None."""
    return _absorbed("mla_absorb_out", o, w, dn)


def _absorbed(name: str, x: torch.Tensor, w, dn: int) -> torch.Tensor | None:
    if name in _BROKEN or not enabled(x) or x.shape[0] != 1 or getattr(w, "format", None) not in ("int8", "bf16"):
        return None
    from deltafin.kernels import triton_decode

    H, R = x.shape[1], w.shape[1]
    dv = w.shape[0] // H - dn
    if dv <= 0 or w.shape[0] != H * (dn + dv) or not triton_decode.absorb_fits(dn, dv, R):
        return None
    s = w.scale.float() if w.format == "int8" else None
    return _run(name, lambda: getattr(triton_decode, name)(x, w.data, s, dn, dv))


def mla_attend(q_lat: torch.Tensor, q_rot: torch.Tensor, rows: torch.Tensor, pos, scale: float) -> torch.Tensor | None:
    """One token's absorbed MLA attention over the latent rows in one pass (``triton_decode.mla_attend``), or
    None (the torch form runs)."""
    if "mla_attend" in _BROKEN or not enabled(q_lat) or q_lat.shape[0] != 1 or rows.dtype != q_lat.dtype:
        return None
    from deltafin.kernels import triton_decode

    R, RR = q_lat.shape[-1], q_rot.shape[-1]
    if rows.dim() != 2 or rows.shape[1] != R + RR or rows.stride(1) != 1 or rows.stride(0) != R + RR or \
            not triton_decode.attend_fits(q_lat.shape[1], R, RR):
        return None
    return _run("mla_attend", lambda: triton_decode.mla_attend(q_lat, q_rot, rows, pos, scale))


def router_topk(x: torch.Tensor, w, bias: torch.Tensor | None, k: int, renorm: bool, scaling: float, eps: float):
    """A decode step's routing in one launch (``triton_decode.router_topk``): (ids, weights), or None (the torch
    form runs) for more than a few tokens or a router the kernel does not take."""
    if "router_topk" in _BROKEN or not enabled(x) or x.shape[0] > 4 or getattr(w, "format", None) not in ("bf16", "f32"):
        return None
    from deltafin.kernels import triton_decode

    if not triton_decode.router_fits(w.shape[0], k):
        return None
    return _run("router_topk", lambda: triton_decode.router_topk(x, w.data, bias, k, renorm, scaling, eps))


def _run(name: str, fn):
    """fn() of a fused kernel; a build failure is logged once and that kernel's torch form runs from then on."""
    try:
        y = fn()
    except Exception as e:  # noqa: BLE001 - a Triton build failure must not stop a run: the torch forms are exact
        log.warning("fused %s off, its torch form runs: %s: %s", name, type(e).__name__, e)
        _BROKEN.add(name)
        return None
    USED.add(f"triton:{name}")
    return y


def xxh3_available(device: torch.device) -> bool:
    """Whether ``xxh3_64_rows`` runs its kernel for tensors on ``device`` (CUDA with Triton, or the interpreter)."""
    if not kernel_device(device) or "xxh3_64" in _BROKEN:
        return False
    try:
        import deltafin.kernels.triton_xxh3  # noqa: F401
    except ImportError as e:
        log.warning("xxh3 on the GPU off, reads are checked on the host: %s", e)
        _BROKEN.add("xxh3_64")
        return False
    return True


def xxh3_64_rows(data: torch.Tensor, rows: Sequence[int], lengths: Sequence[int],
                 launched: Callable[[], None] | None = None) -> list[int] | None:
    """xxh3-64 digests (``xxhash.xxh3_64_intdigest``) of rows of a uint8 device tensor [N, stride], row
    ``rows[i]`` over its first ``lengths[i]`` bytes, in one pair of launches; rows of at most 240 bytes are
    hashed on the host. ``launched`` runs once the launches are queued, before the host waits for their result
    (a CUDA event to time them). None where the kernel does not run here (the caller hashes on the host)."""
    import numpy as np
    import xxhash

    if not xxh3_available(data.device):
        return None
    from deltafin.kernels import triton_xxh3
    from deltafin.kernels.xxh3_ref import MIDSIZE_MAX

    long = [i for i, n in enumerate(lengths) if n > MIDSIZE_MAX]
    try:
        acc = triton_xxh3.lanes(data, [rows[i] for i in long], [lengths[i] for i in long]) if long else None
    except Exception as e:  # noqa: BLE001 - a Triton build failure must not stop a run: the host hashes instead
        log.warning("xxh3 on the GPU off, reads are checked on the host: %s: %s", type(e).__name__, e)
        _BROKEN.add("xxh3_64")
        return None
    if launched is not None:
        launched()
    out = [0] * len(lengths)
    for i, n in enumerate(lengths):
        if n <= MIDSIZE_MAX:
            out[i] = xxhash.xxh3_64_intdigest(np.ascontiguousarray(data[rows[i], :n].cpu().numpy()))
    if acc is not None:
        for i, d in zip(long, triton_xxh3.digests(acc, [lengths[i] for i in long]), strict=True):
            out[i] = d
        USED.add("triton:xxh3_64")
    return out


def grouped_eligible(x: torch.Tensor, tensors) -> bool:
    from deltafin.kernels.triton_moe import MOE_FORMATS

    if not enabled(x) or set(tensors) != set(_ROLES):
        return False
    fmts = {getattr(tensors[r], "format", None) for r in _ROLES}
    return len(fmts) == 1 and fmts <= MOE_FORMATS


def grouped_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, fetched: Sequence[tuple[int, dict]],
                glu: tuple, slab=None) -> torch.Tensor:
    """All of a layer's routed experts in two launches. ``fetched`` holds (expert id, tensors) for every
    id in ``ids``; experts whose tensors are views into ``slab`` are used in place, the others are copied
    into a scratch slab first. ``glu`` is ("silu",) or ("situ", beta, linear_beta)."""
    from deltafin.kernels.triton_moe import ACT_SILU, ACT_SITU, ExpertSlab, grouped_glu

    slot_of = {e: slab.slot_of(t) for e, t in fetched} if slab is not None else {}
    if slab is None or None in slot_of.values():
        order = [e for e, _ in fetched]
        slab = ExpertSlab.stack([t for _, t in fetched], x.device)
        slot_of = {e: i for i, e in enumerate(order)}
    ids = ids.cpu()  # already on the host when it comes from moe_dispatch (no second synchronisation)
    table = torch.full((int(ids.max()) + 1,), -1, dtype=torch.int64)
    for e, s in slot_of.items():
        table[e] = s
    slots = table[ids]
    act, beta, lbeta = (ACT_SILU, 4.0, 25.0) if glu[0] == "silu" else (ACT_SITU, float(glu[1]), float(glu[2]))
    USED.add(f"triton:grouped_{slab.format}")
    return grouped_glu(x, slots, weights, slab, act, beta, lbeta)


def kda_products(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, b: torch.Tensor, sub: int):
    """KDA's in-chunk products L and P (``kda._products``'s contract) in one Triton pass, or None where the
    sub-block is too small for the kernel's tiles and the torch form applies. Callers ask ``enabled`` first."""
    from deltafin.kernels import EXP_LIMIT, triton_kda

    if not triton_kda.products_fit(k.shape[2], k.shape[3], sub):
        return None
    USED.add("triton:kda_products")
    return triton_kda.kda_products(q, k, G, b, sub, EXP_LIMIT)


def _small(name: str, x: torch.Tensor, width: int, *args):
    """A kernel of ``triton_small`` on x, or None where the torch form applies (not the kernel path, a row
    too wide, or that kernel failed to build here, which is logged once)."""
    if name in _BROKEN or not enabled(x):
        return None
    from deltafin.kernels import triton_small

    if not triton_small.fits(width):
        return None
    return _run(name, lambda: getattr(triton_small, name)(*args))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """Fused RMSNorm of x [..., D] with float32 w [D], or None (the torch form runs)."""
    return _small("rms_norm", x, x.shape[-1], x, w, eps)


def mix_norm(V: torch.Tensor, w_mix: torch.Tensor, w_norm: torch.Tensor, eps_mix: float, eps_norm: float
             ) -> torch.Tensor | None:
    """Fused AttnRes mix of V [S, T, D] and RMSNorm of the result, or None (the torch forms run)."""
    return _small("mix_norm", V, V.shape[-1], V, w_mix, w_norm, eps_mix, eps_norm)


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta: float, lbeta: float) -> torch.Tensor | None:
    """Fused SiTU-GLU activation, or None (the torch form runs)."""
    return _small("situ_glu", g, 0, g, u, beta, lbeta)


def kda_step(x: torch.Tensor, H: int, K: int, W: int, hist: torch.Tensor, S: torch.Tensor, *args):
    """One token of a KDA layer from its projections to the gated norm (``triton_small.kda_step``), or None
    (the torch forms run)."""
    from deltafin.kernels import triton_small

    if not (triton_small.kda_fits(H, K, W) and hist.is_contiguous() and S.is_contiguous()):
        return None
    return _small("kda_step", x, 0, *args[:6], hist, *args[6:12], S, *args[12:])


def gdn_step(x: torch.Tensor, Hk: int, Hv: int, K: int, V: int, W: int, hist: torch.Tensor, S: torch.Tensor,
             *args):
    """One token of a Gated DeltaNet layer from its projections to the gated norm (``triton_small.gdn_step``),
    or None (the torch forms run)."""
    from deltafin.kernels import triton_small

    if not (triton_small.gdn_fits(Hk, Hv, K, V, W) and hist.is_contiguous() and S.is_contiguous()):
        return None
    qkv, taps, z, b, a, A, dt_bias, o_norm, *rest = args
    return _small("gdn_step", x, 0, qkv, taps, hist, z, b, a, A, dt_bias, o_norm, S, Hk, *rest)
