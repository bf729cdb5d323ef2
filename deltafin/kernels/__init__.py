"""One dispatch point for weight matmuls: the exact plain-torch path, or a fused kernel per device and format.

``matmul(x, w)`` (reached through ``models.base.linear``) runs the plain torch path (``torch_ref``) unless the
caller turned the fast path on for its thread with ``with kernels.fast():`` (the engine does, unless
``--exact``). On the fast path the backend is chosen by ``x.device.type``: ``cpu`` (compiled C kernels,
``kernels/cpu.py``) or ``cuda`` (Triton kernels, ``kernels/triton.py``, imported only when Triton imports);
a backend offers ``{format}_linear(x, data, scale) -> [T, out]`` for the formats it fuses. Anything a
backend does not cover (plain weights, other formats, a missing backend) takes the torch path, so the fast
path never refuses a model. The checks of expert files already in device memory dispatch here too
(``xxh3_64_rows``: the xxh3 kernel on CUDA, else None and the caller hashes on the host).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

import torch

from deltafin.kernels import cuda as kc
from deltafin.kernels import torch_ref
from deltafin.kernels.invariance import ENABLED as _INVARIANT
from deltafin.quant.record import QTensor

log = logging.getLogger(__name__)
FUSED_FORMATS = ("mxfp4", "int4g32", "int8")
_FAST: contextvars.ContextVar[bool] = contextvars.ContextVar("deltafin_fast_kernels", default=False)
INVARIANT_ROWS = 8  # plain torch matmuls run on blocks of exactly this many rows when batch-invariant
_BACKENDS: dict[str, ModuleType | None] = {}
USED: set[str] = set()  # fused kernels run so far in this process ("cpu:mxfp4_linear"), for the stats line


@contextlib.contextmanager
def fast(enabled: bool = True) -> Iterator[None]:
    """Within this block (this thread), weight matmuls take the fused kernels where a backend has them."""
    token = _FAST.set(enabled)
    try:
        yield
    finally:
        _FAST.reset(token)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Within this block (this thread), every token's result is the same whatever other tokens share its calls:
    the CPU kernels keep their few-token path at every token count (in calls of at most FUSED_TOKENS), and plain
    torch matmuls run on blocks of INVARIANT_ROWS rows (a BLAS picks its kernel, and with it the order of each
    row's sums, by the number of rows). Costs: docs/DETERMINISM.md."""
    token = _INVARIANT.set(enabled)
    try:
        yield
    finally:
        _INVARIANT.reset(token)


@contextlib.contextmanager
def serial() -> Iterator[None]:
    """Within this block, torch's CPU math runs on one thread: a small float32 product whose sums MKL would split
    by the thread count gives the same bits at any ``-t`` (docs/DETERMINISM.md); the packer's own threads encode
    an expert each without torch's wake-ups."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def invariant_enabled() -> bool:
    return _INVARIANT.get()


def _ref_matmul(x: torch.Tensor, w: QTensor | torch.Tensor) -> torch.Tensor:
    """The plain torch product; batch-invariant on blocks of INVARIANT_ROWS rows (the last padded with zeros), so
    a row's sums run in the same order at any row count and position (tests/test_determinism.py checks it)."""
    if not _INVARIANT.get() or x.dim() < 2:
        return torch_ref.matmul(x, w)
    lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
    n, R = x2.shape[0], INVARIANT_ROWS
    pad = (-n) % R
    if pad:
        x2 = torch.cat((x2, x2.new_zeros(pad, x2.shape[1])))
    y = torch.cat([torch_ref.matmul(x2[i : i + R], w) for i in range(0, n + pad, R)])
    return y[:n].reshape(*lead, y.shape[-1])


@contextlib.contextmanager
def math(exact: bool, device_type: str, invariant: bool = False) -> Iterator[None]:
    """The engine's compute path for model calls in this block: the fused kernels unless ``exact``, and on the CPU's
    fast path denormals flushed to zero (``cpu.denormals_flushed``); the exact path keeps IEEE arithmetic.
    ``invariant``: batch-invariant results (``batch_invariant``)."""
    with fast(not exact), batch_invariant(invariant):
        cpu = None if exact or device_type != "cpu" else backend("cpu")
        if cpu is None:
            yield
            return
        with cpu.denormals_flushed():
            yield


def fast_enabled() -> bool:
    return _FAST.get()


def _cpu_fast(x: torch.Tensor) -> ModuleType | None:
    """The CPU backend where x's step is on it: the fast path, a float32 tensor on the CPU."""
    if not _FAST.get() or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return backend("cpu")


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, scale: float, window: int | None,
                sinks: torch.Tensor | None) -> torch.Tensor | None:
    """One or many queries' causal attention in one compiled call (``cpu.attend_rows``), or None: the caller's torch form
    runs (the exact path, other devices and dtypes)."""
    be = _cpu_fast(q)
    return None if be is None else be.attend_rows(q, k, v, pos, scale, window, sinks)


def rms_rows(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm in one compiled call on the CPU's fast path (``cpu.rms_rows``), else None."""
    be = _cpu_fast(x)
    return None if be is None else be.rms_rows(x, w, eps)


def rope_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """One token's NeoX-paired rotation in one compiled call on the CPU's fast path (``cpu.rope1``), else None."""
    be = _cpu_fast(x)
    return None if be is None else be.rope1(x, cos, sin)


def gqa_table(device_type: str, *args, **kw):
    """A GQA layer's records prepared for ``gqa_one`` on this device's backend (``cpu.gqa_table``), or None where no
    backend fuses the one-token attention block."""
    be = backend(device_type) if device_type == "cpu" else None
    fn = getattr(be, "gqa_table", None)
    return None if fn is None else fn(*args, **kw)


def gqa_one(table, x: torch.Tensor, *args) -> torch.Tensor | None:
    """x + one token's whole GQA attention block (norm, q/k/v, their norms and rotation, the cache write, the
    attention, o) in one compiled call on the CPU's fast path (``cpu.gqa_one``), else None: the separate calls run."""
    be = _cpu_fast(x)
    return None if be is None or table is None else be.gqa_one(table, x, *args)


def mla_absorbed_cpu(q_nope: torch.Tensor, w, dn: int, dv: int):
    """One token's absorbed MLA projections from an int8 kv_b_proj record on the CPU's fast path, without a float
    copy of it: (q_lat [1, H, R], out(o [1, H, R]) -> [1, H*dv]), else None (the torch form runs). The query
    side reads a transposed int8 copy of each head's W_uk (made once per record, half of kv_b's bytes), the
    activation times W_uk's row scales; the output side reads W_uv's rows where they are."""
    be = _cpu_fast(q_nope)
    if be is None or q_nope.shape[0] != 1 or getattr(w, "format", None) != "int8":
        return None
    H = q_nope.shape[1]
    rows, R = w.shape
    if rows != H * (dn + dv):
        return None
    wh, sh = w.data.view(H, dn + dv, R), w.scale.to(torch.float32).view(H, dn + dv)
    got = _UK_T.get(id(w.data))
    if got is None or got[0]() is not w.data:
        got = _UK_T[id(w.data)] = (weakref.ref(w.data), wh[:, :dn].transpose(1, 2).contiguous())  # [H, R, dn]
        weakref.finalize(w.data, _UK_T.pop, id(w.data), None)
    q_lat = be.int8_heads((q_nope[0] * sh[:, :dn]).contiguous(), got[1], None)
    if q_lat is None:
        return None

    def out(o: torch.Tensor) -> torch.Tensor:
        return be.int8_heads(o[0], wh[:, dn:], sh[:, dn:]).reshape(1, H * dv)

    return q_lat.view(1, H, R), out


_UK_T: dict[int, tuple] = {}  # id of kv_b's int8 data -> (a weak reference to it, its W_uk transposed), while it lives


def route_one(x: torch.Tensor, ln: torch.Tensor, eps: float, router: torch.Tensor, k: int, renorm: bool):
    """One token's MoE input rms(x, ln) and its softmax top-k routing over a float32 router in one compiled call on
    the CPU's fast path (``cpu.route1``: (h [1, D], ids, weights [k])), else None."""
    be = _cpu_fast(x)
    return None if be is None else be.route1(x, ln, eps, router, k, renorm)


def glu_into(h: torch.Tensor, experts: list, slots: list[int], y: torch.Tensor, act: tuple = ("silu",)) -> bool:
    """One token's gated 4-bit experts into rows ``slots`` of y in one compiled call (``cpu.glu_into``); False where
    it does not apply (nothing written: the caller runs them one at a time)."""
    be = _cpu_fast(h)
    return False if be is None else be.glu_into(h, experts, slots, y, act)


def moe_sum_one(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x + sum over slots of w[s] y[s] in slot order (``cpu.moe_sum1``); the torch form where the kernels are off."""
    be = _cpu_fast(x)
    if be is None:
        return x + (y * w.to(y.dtype).unsqueeze(-1)).sum(0, keepdim=True)
    return be.moe_sum1(x, y, w)


def _load(device_type: str) -> ModuleType | None:
    if device_type == "cpu":
        from deltafin.kernels import cpu

        return cpu if cpu.available() else None
    if device_type == "cuda":
        try:
            importlib.import_module("triton")
            return importlib.import_module("deltafin.kernels.triton")
        except ImportError as e:  # no Triton, or no CUDA backend in this build: the torch path runs
            log.warning("fast CUDA kernels off, the plain torch path runs: %s", e)
            return None
    return None


def backend(device_type: str) -> ModuleType | None:
    """The fused-kernel module for a device type, loaded once per process (None: torch path only)."""
    if device_type not in _BACKENDS:
        _BACKENDS[device_type] = _load(device_type)
    return _BACKENDS[device_type]


def backend_name(device_type: str) -> str:
    """What the fast path runs on this device, for stats lines and benchmarks."""
    be = backend(device_type)
    return "torch" if be is None else be.__name__.rsplit(".", 1)[-1]


def used() -> list[str]:
    """Every fused kernel run so far in this process, as ``backend:kernel``, for the stats line."""
    names = set(USED) | set(kc.USED)
    mlx = sys.modules.get("deltafin.kernels.mlx")  # the MLX engine's kernels, where it ran
    names |= set(mlx.USED) if mlx is not None else set()
    for dev, be in _BACKENDS.items():
        names |= {f"{backend_name(dev)}:{n}" for n in getattr(be, "USED", ())}
    return sorted(names)


def matmul(x: torch.Tensor, w: QTensor | torch.Tensor) -> torch.Tensor:
    """x [..., in] @ W^T for a weight record [out, in] in any format; the result is in x's dtype."""
    if not (isinstance(w, QTensor) and w.format in FUSED_FORMATS and len(w.shape) == 2):
        return _ref_matmul(x, w)
    if kc.enabled(x):  # bf16 activations on CUDA are the fast path's (float32, the reference, is not)
        lead = x.shape[:-1]
        y = kc.linear(x.reshape(-1, x.shape[-1]), w)
        if y is not None:
            return y.reshape(*lead, w.shape[0]).to(x.dtype)
    if _FAST.get():
        fn = getattr(backend(x.device.type), f"{w.format}_linear", None)
        if fn is not None:
            if not hasattr(backend(x.device.type), "USED"):  # backends that name their own variants keep them
                USED.add(f"{backend_name(x.device.type)}:{w.format}_linear")
            lead = x.shape[:-1]
            y = fn(x.reshape(-1, x.shape[-1]), w.data, w.scale)  # [T, out]
            return y.reshape(*lead, w.shape[0]).to(x.dtype)
    return _ref_matmul(x, w)


def glu(x: torch.Tensor, gate: QTensor | torch.Tensor, up: QTensor | torch.Tensor, down: QTensor | torch.Tensor,
        act: tuple = ("silu",), rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """down(act(gate x, up x)) for x [T, D] in one fused call where the fast path has one (the CPU backend's 4-bit
    experts), in x's dtype; None where the caller runs the three matmuls. act: ``("silu",)`` (SwiGLU) or
    ``("situ", beta, linear_beta)`` (Kimi K3's SiTU-GLU). rows (int64 [T]): the tokens are those rows of x
    (read in place where the kernel can), the result that of ``glu(x[rows], ...)``."""
    if not _FAST.get() or x.device.type != "cpu" or x.dim() != 2:
        return None
    fn = getattr(backend("cpu"), "glu_expert", None)
    y = None if fn is None else fn(x, gate, up, down, act) if rows is None else fn(x, gate, up, down, act, rows=rows)
    return y if y is None or y.dtype == x.dtype else y.to(x.dtype)


def glu_many(x: torch.Tensor, toks: list[torch.Tensor | None], experts: list, act: tuple = ("silu",)
             ) -> list[torch.Tensor | None] | None:
    """[glu(x if tok is None else x[tok], t["gate"], t["up"], t["down"], act) for tok, t in zip(toks, experts)]
    (expert tensors by role; each expert on its rows of x, or all of it) in one call where the fast path has one:
    the CPU backend's 4-bit experts on few tokens, their rows shared out over the threads, bit for bit. An expert
    it leaves out is None in the list (only those it runs are gathered), and None instead of a list means the
    caller runs them all one at a time."""
    if not _FAST.get() or x.device.type != "cpu" or x.dim() != 2 or len(experts) < 2:
        return None
    be = backend("cpu")
    fn, few = getattr(be, "glu_experts", None), getattr(be, "glu_many_tokens", None)
    if fn is None or few is None:
        return None
    limit = few()
    pick = [i for i, tok in enumerate(toks) if (x.shape[0] if tok is None else tok.numel()) <= limit]
    try:
        recs = [(experts[i]["gate"], experts[i]["up"], experts[i]["down"]) for i in pick]
    except KeyError:  # other roles (gpt-oss's fused gate_up): not a plain gated expert
        return None
    ys = fn([x if toks[i] is None else x[toks[i]] for i in pick], recs, act) if len(pick) > 1 else None
    if ys is None:
        return None
    out: list[torch.Tensor | None] = [None] * len(experts)
    for i, y in zip(pick, ys, strict=True):
        out[i] = y if y is None or y.dtype == x.dtype else y.to(x.dtype)
    return out


def swiglu(x: torch.Tensor, gate: QTensor | torch.Tensor, up: QTensor | torch.Tensor,
           down: QTensor | torch.Tensor) -> torch.Tensor | None:
    """down(silu(gate x) * up x): ``glu`` with SwiGLU."""
    return glu(x, gate, up, down, ("silu",))


EXP_LIMIT = 80.0  # KDA: largest exponent a decay factor may take: K * e^80 stays far below float32's max (e^88.7)
EXP_FLOOR = -87.0  # e^-87 = 1.6e-38, just above float32's smallest normal (1.18e-38)


def exp_(x: torch.Tensor) -> torch.Tensor:
    """e^x in place, for a temporary of log-decays (x <= 0): ``x.exp_()``, except that on the fast CPU path x is
    first raised to EXP_FLOOR. The CPU's exp takes a slow path for results below the smallest normal float32 (45x
    slower on [8, 96, 64, 128] log-decays of a 64-token chunk, most of them below -87), and where they enter KDA's
    sums (beside decays near 1 and products of unit-norm keys) e^-87 and e^-300 are both nothing: the absolute
    change per factor is under 1.7e-38. The exact path and the GPU keep exp."""
    if _FAST.get() and x.device.type == "cpu":
        x.clamp_(min=EXP_FLOOR)
    return x.exp_()


def xxh3_available(device: torch.device) -> bool:
    """Whether ``xxh3_64_rows`` hashes tensors on ``device`` there (CUDA with Triton)."""
    return kc.xxh3_available(torch.device(device))


def xxh3_64_rows(data: torch.Tensor, rows: Sequence[int], lengths: Sequence[int],
                 launched: Callable[[], None] | None = None) -> list[int] | None:
    """xxh3-64 digests of rows of a uint8 tensor on the device (expert files in their slab slots), row ``rows[i]``
    over its first ``lengths[i]`` bytes, in one pair of launches; None where no kernel runs for that device (the caller
    hashes on the host). ``launched``: called once the launch is queued, before the host waits for it."""
    return kc.xxh3_64_rows(data, rows, lengths, launched)


def matmul_many(x: torch.Tensor, ws: list[QTensor | torch.Tensor]) -> list[torch.Tensor]:
    """[matmul(x, w) for w in ws] for matrices that read the same x [T, in]; on the fast CPU path int8 records
    run in one fused call (x quantized once, one parallel pass), with the results of separate calls."""
    if (_FAST.get() and x.device.type == "cpu" and x.dim() == 2 and len(ws) > 1
            and all(isinstance(w, QTensor) and w.format == "int8" and len(w.shape) == 2 for w in ws)):
        fn = getattr(backend("cpu"), "int8_linear_many", None)
        ys = None if fn is None else fn(x, list(ws))
        if ys is not None:
            return [y if y.dtype == x.dtype else y.to(x.dtype) for y in ys]
    return [matmul(x, w) for w in ws]
