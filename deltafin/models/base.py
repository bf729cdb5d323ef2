"""What every model module relies on: weights as records, an injected expert source, per-layer state.

Model modules are pure math. They never open files, start threads or print. Routed experts come from
an ``ExpertSource``: the MoE block asks for ``(layer, expert ids)`` and gets each expert's tensors back
in *arrival order* (cached ones first, then misses as their reads land). To keep output independent of
arrival order, a model writes each expert's result into its own slot and sums the slots in a fixed order.

Every family module exports ``Config`` (``Config.from_dict(d)`` ignores unknown keys) and
``Model(cfg, weights, device="cpu", dtype=torch.float32)`` with ``num_layers``, ``vocab_size`` and:

- ``new_state(max_len) -> SequenceState``: empty per-layer state for one sequence.
- ``embed(ids [T]) -> carry``: the stream entering layer 0 (the residual stream [T, D]; Kimi K3: a ``Carry``).
- ``attn_part(i, carry, state) -> carry``: layer i's attention for T tokens at positions ``state.pos``..
- ``mlp_part(i, carry, experts) -> carry``: layer i's dense MLP or MoE. Token-wise, so the carries of several
  sequences at the same layer may be concatenated along T.
- ``route(i, carry) -> (ids [T, k] long, weights [T, k] float32) | None``: the experts that
  ``mlp_part(i, carry, ...)`` fetches, for the same carry (``attn_part``'s output): the pre-MLP norm (and
  K3's AttnRes mix) is applied inside, and the weights are those the expert outputs are scaled by (routed
  scaling factor included). None for a dense layer.
- ``head(carry) -> logits [T, V]`` float32.
- ``forward(ids, state, experts) -> logits [T, V]``: embed, every layer, head; advances ``state.pos`` by T.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Protocol

import torch

from deltafin.kernels import cuda as kc
from deltafin.kernels import glu_many, matmul, matmul_many, rms_rows
from deltafin.quant.record import QTensor, dequantize

Weights = Mapping[str, QTensor]  # trunk tensors by packed name (checkpoint name minus any prefix)
ExpertTensors = Mapping[str, QTensor]  # roles: gate/up/down, or gpt-oss gate_up/gate_up_bias/down/down_bias


class ExpertSource(Protocol):
    def fetch(self, layer: int, expert_ids: Sequence[int]) -> Iterable[tuple[int, ExpertTensors]]:
        """Yield (expert id, tensors) once for every requested id, in arrival order."""
        ...

    # Optional: fetch_groups(layer, expert_ids) yields lists of (expert id, tensors), every requested id once, where
    # each list's tensors stay valid until the next list is asked for (fetch may reuse an expert's memory as soon
    # as the next one is asked for): the experts already in memory come as one list, whose experts on few tokens
    # (a decode step's) moe_dispatch runs in one call over all cores.


class ResidentExperts:
    """All experts in memory (tests, tiny models, the all-resident reference path)."""

    def __init__(self, experts: Mapping[tuple[int, int], ExpertTensors], device: torch.device | str = "cpu"):
        self.experts = {k: {n: t.to(device) for n, t in v.items()} for k, v in experts.items()}

    def fetch(self, layer: int, expert_ids: Sequence[int]) -> Iterator[tuple[int, ExpertTensors]]:
        for e in expert_ids:
            yield e, self.experts[(layer, e)]

    def fetch_groups(self, layer: int, expert_ids: Sequence[int]) -> Iterator[list[tuple[int, ExpertTensors]]]:
        yield [(e, self.experts[(layer, e)]) for e in expert_ids]


def linear(x: torch.Tensor, w: QTensor | torch.Tensor, bias: QTensor | torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ b) for a weight record [out, in] in any format, computed in x's dtype."""
    return _plus_bias(matmul(x, w), bias, x.dtype)


def _plus_bias(y: torch.Tensor, bias: QTensor | torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return y if bias is None else y + (bias if isinstance(bias, torch.Tensor) else dequantize(bias, dtype)).to(dtype)


def linears(x: torch.Tensor, ws: Sequence[QTensor | torch.Tensor],
            biases: Sequence[QTensor | torch.Tensor | None]) -> list[torch.Tensor]:
    """[linear(x, w, b) for w, b in zip(ws, biases)] for x [T, in]: matrices that read the same input (q, k, v),
    which the fast path may run in one call (``kernels.matmul_many``)."""
    ys = matmul_many(x, list(ws)) if x.dim() == 2 else [matmul(x, w) for w in ws]
    return [_plus_bias(y, b, x.dtype) for y, b in zip(ys, biases, strict=True)]


def stack_rows(w: dict, names: Sequence[str]) -> QTensor | None:
    """One int8 record [sum out, in] of the records ``names`` (matrices that read the same input), each entry
    of ``w`` replaced by a row view of it: a one-token step then runs them as one GEMV (one launch, one pass
    over x) and, once the caller drops the originals, at no extra memory. The views keep every other path
    as it was. None (``w`` unchanged) unless all are 2-D int8 records of one input width on one device."""
    ts = [w.get(n) for n in names]
    if not all(isinstance(t, QTensor) and t.format == "int8" and len(t.shape) == 2 and t.scale is not None
               for t in ts) or len({(t.shape[1], t.data.device) for t in ts}) != 1:
        return None
    data, scale = torch.cat([t.data for t in ts]), torch.cat([t.scale for t in ts])
    r0 = 0
    for n, t in zip(names, ts, strict=True):
        w[n] = QTensor("int8", t.shape, data[r0 : r0 + t.shape[0]], scale[r0 : r0 + t.shape[0]])
        r0 += t.shape[0]
    return QTensor("int8", (r0, ts[0].shape[1]), data, scale)


def dense(w: QTensor | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The plain tensor of a record (norm weights, biases, embeddings rows)."""
    return w.to(dtype) if isinstance(w, torch.Tensor) else dequantize(w, dtype)


def embed_rows(w: QTensor | torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` [T] of an embedding record [V, D] -> [T, D], dequantizing only those rows (every format
    keeps its scales per row), bit-identical to ``dense(w, dtype)[ids]``."""
    if isinstance(w, torch.Tensor):
        return w[ids].to(dtype)
    rows = QTensor(
        w.format, (ids.numel(), *w.shape[1:]), w.data[ids], None if w.scale is None else w.scale[ids]
    )
    return dequantize(rows, dtype)


def rms_norm(x: torch.Tensor, w: QTensor | torch.Tensor, eps: float) -> torch.Tensor:
    wf = dense(w, torch.float32)
    # bf16 on the CUDA kernel path: one fused launch; the CPU's fast path (float32): one compiled call; else (the
    # float32 reference) the torch form below
    y = kc.rms_norm(x, wf, eps) if kc.enabled(x) else rms_rows(x, wf, eps) if x.device.type == "cpu" else None
    if y is not None:
        return y
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return wf.mul(y).to(x.dtype)


class SequenceState:
    """One sequence's state: the next position and one model-specific object per layer (KV cache,
    latent cache, recurrent state...). Models create it with ``Model.new_state()``.

    ``at``, when set, holds ``pos`` as a one-element device tensor for a one-token step recorded into a CUDA
    graph (``runtime/cuda_graphs.py``): a model that supports it then reads the position from there, not
    from the Python int, so a replay at any later position computes the right thing."""

    def __init__(self, layers: list):
        self.pos = 0
        self.layers = layers
        self.at: torch.Tensor | None = None


def forward_parts(model, ids: torch.Tensor, state: SequenceState, experts) -> torch.Tensor:
    """One pass of ids through a model's parts (embed, each layer's attention then MLP, head): the forward of
    every model that is built from them, in torch, on MLX or split over two devices. Returns the logits [T, V]."""
    x = model.embed(ids)
    for i in range(model.num_layers):
        x = model.mlp_part(i, model.attn_part(i, x, state), experts)
    state.pos += ids.shape[0]
    return model.head(x)


ROW_ALIGN = 64  # floats: a multiple of every x86 build's vector body (two AVX-512 vectors: 32)


def rowwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn (elementwise) on x [T, E] with each row padded to a multiple of ROW_ALIGN: torch runs a tensor's
    elementwise body in vector units and its last elements through a scalar loop whose transcendental functions
    round otherwise, so a narrow row's values (a router's few experts, a [T, 1] gate) would depend on how many
    rows share the call. Padded, every row lies in the vector body: batch-invariant."""
    E = x.shape[-1]
    pad = (-E) % ROW_ALIGN
    if pad == 0 or x.device.type != "cpu":
        return fn(x)
    return fn(torch.nn.functional.pad(x, (0, pad)))[..., :E]


def unique_ids(ids_host: torch.Tensor) -> list[int]:
    """The distinct expert ids of a host tensor, ascending (a count per id: a tenth of a sort's time at 65,536
    prefill pairs)."""
    flat = ids_host.reshape(-1)
    if flat.numel() == 0:
        return []
    return torch.bincount(flat).nonzero().reshape(-1).tolist()


def ids_to_host_during(ids: torch.Tensor, side):
    """(the router's ids on the host, side()): the ids' copy starts first, so the device work side() queues
    (what does not depend on routing) runs while the copy lands and the host plans the experts."""
    if not ids.is_cuda:
        return ids, side()
    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
    host.copy_(ids, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    out = side()
    ready.synchronize()
    return host, out


def moe_dispatch(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    layer: int,
    experts: ExpertSource,
    expert_fn,
    glu: tuple | None = None,
    ids_host: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the routed experts of one layer over all tokens at once (expert-major).

    Legend: T tokens, k experts per token, D model width. ``ids``/``weights`` are [T, k].
    Each requested expert runs once on all of its tokens as soon as it arrives; results land in
    per-(token, slot) buffers and are summed over k in slot order, so arrival order cannot change them.
    ``glu`` names the expert's gated activation (("silu",) or ("situ", beta, linear_beta)) for the
    grouped CUDA kernels, which run every expert of the layer in two launches once all have arrived.

    A source split over ranks (``runtime/distributed.py``) may also define ``agree(layer, ids, weights)``
    (the routing every rank uses), ``local(layer, wanted)`` (the ids it computes here) and
    ``combine(layer, out, ids)`` (the [T, k, D] slot buffers of all ranks summed, each slot filled by one
    rank and zero elsewhere, so the sum over k below is the single-process one, bit for bit).
    ``ids_host``: ids already on the host (``ids_to_host_during``), so the caller could queue other work on the
    device before waiting for them.
    """
    T, D = x.shape
    k = ids.shape[1]
    if hasattr(experts, "agree"):
        ids, weights = experts.agree(layer, ids, weights)
        ids_host = None
    if ids_host is None:
        ids_host = ids.cpu()  # the one host synchronisation of the layer: which experts to fetch
    row = ids_host[0].tolist() if T == 1 else []
    wanted = sorted(set(row)) if T == 1 else unique_ids(ids_host)  # one token: no tensor ops for k ids
    if hasattr(experts, "local"):
        wanted = experts.local(layer, wanted)
    kernel_path = glu is not None and x.dtype == torch.bfloat16 and not hasattr(experts, "combine") and kc.enabled(x)
    # Elsewhere on the CPU the experts a source holds in memory come as one group, whose experts on few tokens run
    # in one call (glu_many)
    grouped = not kernel_path and glu is not None and x.device.type == "cpu" and hasattr(experts, "fetch_groups")
    groups = expert_groups(experts, layer, wanted) if grouped else None
    fetched = None if grouped else experts.fetch(layer, wanted)
    if kernel_path:
        got = list(fetched)
        assert len(got) == len(wanted), f"expert source returned {len(got)} of {len(wanted)} experts"
        if all(kc.grouped_eligible(x, t) for _, t in got):
            timed = getattr(experts, "math_span", None)  # the source's clock (CUDA events) around the launches
            with timed() if timed is not None else contextlib.nullcontext():
                return kc.grouped_moe(x, ids_host, weights, got, glu, getattr(experts, "slab", None))
        fetched = iter(got)
    seen = 0
    # One token (decode): each expert's slot is read off the host ids, with no per-expert index tensors; the
    # same products land in the same slots as below.
    slot_of = {e: s for s, e in enumerate(row)} if T == 1 and len(set(row)) == k else None
    if slot_of is not None:
        by_slot: list[torch.Tensor | None] = [None] * k
        for group in groups if grouped else ([item] for item in fetched):
            for (eid, _), y in zip(group, group_outputs(x, [None] * len(group), group, glu, expert_fn), strict=True):
                by_slot[slot_of[eid]] = y  # [1, D]
                seen += 1
            for eid, tensors in settle(group):  # a copy failed its check: a good copy's result
                by_slot[slot_of[eid]] = expert_fn(x, tensors)
        out = _weighted_slots(by_slot, weights[0], x)  # [1, k, D]
    else:
        # Many tokens: every expert's (token, slot) places from one stable sort of the ids (token order within an
        # expert, as a scan of the ids gives them), and the slot buffer written place by place. Every place is
        # some fetched expert's, so a source that computes them all here writes every row: on the CPU the buffer
        # is kept across layers unzeroed (a fresh one per layer faulted ~100 MB of pages in at Kimi K3's widths); a
        # source split over ranks fills only its own places, the rest must read zero.
        flat = ids_host.reshape(-1)
        order = torch.argsort(flat, stable=True)
        by_id, want = flat[order], torch.tensor(wanted, dtype=flat.dtype)
        span = dict(zip(wanted, zip(torch.searchsorted(by_id, want).tolist(),
                                    torch.searchsorted(by_id, want, right=True).tolist(), strict=True), strict=True))
        order = order.to(x.device)
        tok_of, w_flat = order // k, weights.reshape(-1)
        reuse = x.device.type == "cpu" and not hasattr(experts, "combine")
        out = _slot_buffer(T * k, D, x) if reuse else x.new_zeros(T * k, D)  # [T k, D], row t k + s
        for group in groups if grouped else ([item] for item in fetched):
            toks = [tok_of[slice(*span[eid])] for eid, _ in group]
            for (eid, _), y in zip(group, group_outputs(x, toks, group, glu, expert_fn), strict=True):
                place = order[slice(*span[eid])]
                out[place] = y * w_flat[place].unsqueeze(-1).to(y.dtype)  # y [n, D]
                seen += 1
            for eid, tensors in settle(group):  # a copy failed its check: a good copy's result
                place = order[slice(*span[eid])]
                y = expert_fn(x[tok_of[slice(*span[eid])]], tensors)
                out[place] = y * w_flat[place].unsqueeze(-1).to(y.dtype)
        out = out.view(T, k, D)
    assert seen == len(wanted), f"expert source returned {seen} of {len(wanted)} experts for layer {layer}"
    if hasattr(experts, "combine"):
        out = experts.combine(layer, out, ids)
    return out.sum(1)


def group_outputs(x: torch.Tensor, toks: list[torch.Tensor | None], group: Sequence[tuple[int, ExpertTensors]],
                  glu: tuple | None, expert_fn) -> list[torch.Tensor]:
    """Each expert of a group (expert id, tensors) on its tokens (``toks[i]``: rows of x, or None for all of x):
    in one call (``glu_many``) where the kernels take them, else ``expert_fn(x rows, tensors)`` each; glu_many's
    result, where it ran one, is expert_fn's."""
    tensors = [t for _, t in group]
    ys = glu_many(x, toks, tensors, glu) if len(group) > 1 else None
    return [ys[i] if ys is not None and ys[i] is not None else expert_fn(x if toks[i] is None else x[toks[i]], t)
            for i, t in enumerate(tensors)]


def expert_groups(experts, layer: int, wanted: Sequence[int]) -> Iterator[list[tuple[int, ExpertTensors]]]:
    """``experts.fetch_groups(layer, wanted)``, with the files it can check beside the math handed over before
    their checks where it offers that (``checks_later_ok``): the consumer then calls ``settle`` on each group."""
    if getattr(experts, "checks_later_ok", False):
        return experts.fetch_groups(layer, wanted, checks_later=True)
    return experts.fetch_groups(layer, wanted)


def settle(group) -> list[tuple[int, ExpertTensors]]:
    """(expert id, tensors) to compute again: a group handed over before its check (``runtime.source.LaterChecked``)
    waits for it here, after its math; any other group has none."""
    done = getattr(group, "settle", None)
    return done() if done is not None else []


def _weighted_slots(by_slot: list[torch.Tensor | None], w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One token's [1, k, D] slot buffer, slot s = y_s * w_s in x's dtype (zero where no expert ran here: a
    source split over ranks), from a handful of ops rather than a few per slot."""
    ref = next(y for y in by_slot if y is not None) if any(y is not None for y in by_slot) else x
    ys = torch.cat([y if y is not None else ref.new_zeros(1, x.shape[1]) for y in by_slot])  # [k, D]
    return ys.mul_(w.to(ys.dtype).unsqueeze(-1)).to(x.dtype).unsqueeze(0)


_SLOTS = threading.local()
SLOT_KEEP = 1 << 30  # bytes of slot buffer kept between layers, per thread


def _slot_buffer(n: int, D: int, like: torch.Tensor) -> torch.Tensor:
    """An [n, D] buffer of like's dtype and device, uninitialised, reused by the next layer of this thread (up to
    SLOT_KEEP bytes): its pages are faulted in once per prompt, not once per layer."""
    buf = getattr(_SLOTS, "buf", None)
    if (buf is None or buf.dtype != like.dtype or buf.device != like.device or buf.numel() < n * D
            or buf.is_inference() != torch.is_inference_mode_enabled()):  # an inference tensor is read-only outside
        _SLOTS.buf = None  # the old one goes before the new one is made
        buf = torch.empty(n * D, dtype=like.dtype, device=like.device)
        if buf.numel() * buf.element_size() <= SLOT_KEEP:
            _SLOTS.buf = buf
    return buf[: n * D].view(n, D)
