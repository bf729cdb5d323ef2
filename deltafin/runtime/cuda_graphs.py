"""Kimi K3's one-token decode step as CUDA graphs: the trunk between routing decisions recorded once, replayed.

A decode step of one sequence launches some 150 small kernels per layer; from Python that costs far more
host time than the GPU spends on them. The step is cut where the host must decide something, i.e. at each
MoE layer's routing (which experts to fetch), into *stages*, each recorded as one graph:

- trunk 0: embed, the layers before the first MoE layer, that layer's attention and ``moe_begin`` (AttnRes
  mix and norm, router with top-k on the device); the chosen ids are copied to pinned host memory;
- side j: MoE layer j's ``moe_side`` (latent down projection, shared experts), which does not depend on
  the routing, so the GPU runs it while the host fetches the layer's experts;
- trunk j+1: MoE layer j's routed experts (the grouped kernels over slab slots), its ``moe_end`` (norm,
  up projection, residual), then the next layers up to MoE layer j+1's routing; the last ends with the head.

Between side j and trunk j+1 runs the layer's one host synchronisation: wait for the ids, fetch the experts
from the source (cache or drives) and write the slab slot of each of the k (token, expert) pairs to a
static device buffer that the grouped launch reads (a fixed grid of k blocks of one pair each). A layer whose
experts the source keeps in its slab for good (``resident_slots``: a cache that holds the whole model) has
no synchronisation: its slots are looked up on the device, and the host queues the next stages at once
(on the H200's K3 slice the host's decision left the GPU idle 70-110 us a layer). Where the
source guesses (``--guess-next``), a small graph after trunk j runs MoE layer j+1's router on trunk j's
stream, and that guess goes to the source at the same synchronisation, before layer j's fetch.

Every tensor a graph reads or writes stays put: the token id and its position live in device buffers
(MLA decode reads the position from there and attends over the latent cache's whole static buffer with the
later rows masked: one graph serves every position, at the cost of reading ``max_len`` rows, about 4.7 MB
per layer at 4K tokens, rather than a graph per length bucket, which would multiply recording and memory);
the sequence state is *adopted* (KDA conv history and recurrent state, MLA latent caches at full length
are runner buffers that the state's layers point at, updated in place; a state that was decoding before
gets its own copies back), and each stage's outputs (the AttnRes carry: partial sum and block snapshots;
the routing; z and the shared experts' output) are later stages' inputs.

Graphs are recorded lazily: the first step runs eagerly on a side stream (it compiles the Triton kernels
and sets up cuBLAS there), the second records each stage and replays it, later steps only replay. Where a
stage cannot be replayed (the source handed experts outside the slab the graph reads) it runs eagerly into
the same buffers. Without CUDA, bf16 and the fused kernels the runner runs every stage eagerly (the CPU
tests check it against the plain path); the engine then keeps its plain path.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref

import torch

from deltafin.kernels import cuda as kc
from deltafin.models.base import SequenceState, moe_dispatch
from deltafin.models.kda import KDAState
from deltafin.models.layers import GrowingCache

log = logging.getLogger(__name__)
ENV = "DELTAFIN_CUDA_GRAPHS"  # "0" turns the graphs off (the eager decode path runs)


def why_not(model, experts, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why decode steps of ``model`` cannot be replayed from CUDA graphs here, or None when they can."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if not hasattr(model, "moe_begin"):
        return f"graphs cover Kimi K3 only; {type(model).__module__.rsplit('.', 1)[-1]} decodes eagerly"
    if device.type != "cuda":
        return f"device {device.type} has no CUDA graphs"
    if dtype != torch.bfloat16:
        return f"{str(dtype).removeprefix('torch.')} activations (the exact reference) run eagerly"
    if os.environ.get("DELTAFIN_KERNELS", "triton") != "triton":
        return "DELTAFIN_KERNELS selects the plain torch path"
    if hasattr(experts, "agree") or hasattr(experts, "combine"):
        return "an expert source split over ranks exchanges results on the host every layer"
    return None


class _Listed:
    """An ExpertSource over experts already fetched (the runner fetched them at the routing step)."""

    def __init__(self, got: list):
        self.got = got

    def fetch(self, layer: int, expert_ids):
        yield from self.got


def _copy_into(dst, src) -> None:
    """Write the tensors of ``src`` into the same-shaped tensors of ``dst`` (a stage's static outputs)."""
    if isinstance(dst, torch.Tensor):
        if dst is not src:
            dst.copy_(src)
    elif isinstance(dst, tuple):
        for d, s in zip(dst, src, strict=True):
            _copy_into(d, s)
    elif dataclasses.is_dataclass(dst):
        for f in dataclasses.fields(dst):
            _copy_into(getattr(dst, f.name), getattr(src, f.name))
    else:
        assert dst is None and src is None, f"stage outputs differ in kind: {type(dst)} vs {type(src)}"


class DecodeGraphs:
    """One-token decode steps of a Kimi K3 model over an expert source, replayed from CUDA graphs.

    ``step(ids [1], state) -> logits [1, V]`` advances ``state`` by one token, like the plain path's
    ``forward_batch`` of one sequence. ``capture`` False runs the same stages eagerly (CPU, tests)."""

    def __init__(self, model, experts, capture: bool = True):
        self.model, self.experts = model, experts
        self.capture = capture and model.device.type == "cuda"
        if model.device.type == "cuda":
            model.stack_decode_projections()  # one GEMV per same-input group (idempotent)
        cfg = model.cfg
        self.moe = [i for i in range(model.num_layers) if cfg.is_moe(i)]
        self.k = cfg.num_experts_per_token
        dev = model.device
        self.ids = torch.zeros(1, dtype=torch.long, device=dev)
        self.at = torch.zeros(1, dtype=torch.long, device=dev)
        # the grouped launch of one token: block j holds pair j alone (its other rows -1), so only the
        # slab slot of each block changes from step to step; k distinct experts -> a fixed grid of k blocks
        self.bt = 16
        rows = torch.full((self.k * self.bt,), -1, dtype=torch.int32)
        rows[:: self.bt] = torch.arange(self.k, dtype=torch.int32)
        self.rows = rows.to(dev)
        pin = dev.type == "cuda"
        self.blk = {L: torch.zeros(self.k, dtype=torch.int32, device=dev) for L in self.moe}
        self.blk_host = {L: torch.zeros(self.k, dtype=torch.int32, pin_memory=pin) for L in self.moe}
        self.blk_np = {L: t.numpy() for L, t in self.blk_host.items()}
        self.ids_host = {L: torch.zeros((1, self.k), dtype=torch.long, pin_memory=pin) for L in self.moe}
        self.guess_host = {L: torch.zeros((1, self.k), dtype=torch.long, pin_memory=pin) for L in self.moe}
        self.ids_ready = torch.cuda.Event() if pin else None
        self.decided: dict[int, tuple] = {}  # MoE layer -> ("plan", slab) or ("fetched", [(id, tensors)])
        self.staging = None  # a slab of k slots for experts the source keeps elsewhere
        self._kda: dict[int, KDAState] = {}
        self._mla: dict[int, torch.Tensor] = {}
        self._owner = None
        self.steps = 0
        self.mark = None  # a callable run after each routing step and at the end (benchmarks record events)
        self._reset_graphs()
        self.stream = torch.cuda.Stream(dev) if self.capture else None

    # ------------------------------------------------------------------ graphs
    # Stages, in launch order: trunk 0, side 0, trunk 1, side 1, ..., trunk n (n MoE layers). Trunk j ends
    # with MoE layer j's routing (ids copied to pinned host memory); side j (its latent down projection and
    # shared experts) runs on the GPU while the host fetches that layer's experts; trunk j+1 opens with them.

    def _reset_graphs(self) -> None:
        n = 2 * len(self.moe) + 1
        self.graphs: list = [None] * n
        self.out: list = [None] * n  # each stage's static outputs (later stages' inputs)
        self.slab_of: list = [None] * n  # the slab a recorded stage's grouped launch reads
        self.guess_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # j -> MoE layer j+1's routing guessed after trunk j
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None

    def _give_up(self, why: str) -> None:
        log.warning("CUDA graphs off for decode, steps run eagerly: %s", why)
        self.capture = False
        self._reset_graphs()

    def _record(self, s: int, inp):
        return self._capture_call(lambda: self._stage_fn(s, inp))

    def _capture_call(self, fn):
        g = torch.cuda.CUDAGraph()
        cur = torch.cuda.current_stream()
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                out = fn()
            finally:
                g.capture_end()
        cur.wait_stream(self.stream)
        return g, out

    def _guess(self, j: int, nxt: int, carry) -> bool:
        """Where the source asks for guesses (``StreamingExperts.wants_guess``), MoE layer ``nxt``'s router on trunk
        j's stream ``carry`` (its ids copied to pinned host memory, read at the layer's synchronisation): a graph
        of its own once trunk j is recorded (its output is then static), replayed only on the steps that guess.
        Returns whether it ran."""
        wants = getattr(self.experts, "wants_guess", None)
        if wants is None or not wants(nxt):
            return False
        static = self.graphs[2 * j] is not None
        g = self.guess_graphs.get(j)
        if g is not None and static:
            g.replay()
            return True
        if self.capture and static:
            try:
                g, _ = self._capture_call(lambda: self._guess_fn(nxt, carry))
            except Exception as e:  # noqa: BLE001 - the guess then runs eagerly; the stages stay recorded
                log.warning("the next layer's guess runs eagerly: %s: %s", type(e).__name__, e)
            else:
                self.guess_graphs[j] = g
                g.replay()
                return True
        self._guess_fn(nxt, carry)
        return True

    def _guess_fn(self, nxt: int, carry) -> None:
        ids, _ = self.model.route(nxt, carry)
        self.guess_host[nxt].copy_(ids, non_blocking=True)

    def _run(self, s: int, inp):
        slab = self._slab_before(s)
        if self.graphs[s] is not None and slab is self.slab_of[s]:
            self.graphs[s].replay()
            return self.out[s]
        # record once every earlier stage is recorded (this one's inputs are then static) and the grouped
        # launch opening it, if any, is the fixed-grid one
        if self.capture and self.steps >= 1 and self.graphs[s] is None and all(self.graphs[:s]) \
                and (s % 2 == 1 or s == 0 or slab is not None):
            try:
                g, out = self._record(s, inp)
            except Exception as e:  # noqa: BLE001 - anything that cannot be recorded runs eagerly from now on
                self._give_up(f"stage {s} could not be recorded ({type(e).__name__}: {e})")
            else:
                self.graphs[s], self.out[s], self.slab_of[s] = g, out, slab
                g.replay()
                return out
        out = self._stage_fn(s, inp)
        if self.out[s] is not None:  # a later stage's graph reads the static outputs
            _copy_into(self.out[s], out)
            return self.out[s]
        return out

    def _slab_before(self, s: int):
        """The slab of the grouped launch that opens trunk stage s (None: the first trunk stage, a side
        stage, or a layer whose experts were not all in one slab: no fixed-grid launch)."""
        if s == 0 or s % 2 == 1:
            return None
        kind, arg = self.decided[self.moe[s // 2 - 1]]
        return arg if kind == "plan" else None

    # ------------------------------------------------------------------ the stages (pure model math)

    def _stage_fn(self, s: int, inp):
        m = self.model
        if s % 2 == 1:  # side stage of MoE layer j: inp is trunk j's output
            return m.moe_side(self.moe[s // 2], inp[1])
        j, st = s // 2, self._state
        if j == 0:
            carry, lo = m.embed(self.ids), 0
        else:
            (carry, r), side = inp
            L = self.moe[j - 1]
            carry, lo = m.moe_end(L, carry, r, side, self._routed(L, r, side[0])), L + 1
        hi = self.moe[j] if j < len(self.moe) else m.num_layers
        for i in range(lo, hi):
            carry = m.mlp_part(i, m.attn_part(i, carry, st), None)  # dense layers only
        if j == len(self.moe):
            return m.head(carry)
        carry = m.attn_part(hi, carry, st)
        r = m.moe_begin(hi, carry)
        self.ids_host[hi].copy_(r.ids, non_blocking=True)  # to the host as soon as the router is done
        return carry, r

    def _routed(self, L: int, r, z: torch.Tensor) -> torch.Tensor:
        kind, arg = self.decided[L]
        if kind == "plan":
            from deltafin.kernels.triton_moe import ACT_SITU, MoePlan, grouped_glu, moe_config

            I, K = arg.shapes["gate"]
            plan = MoePlan(self.rows, self.blk[L], 1, self.k, moe_config(self.k, self.k, K, I))
            _, beta, lbeta = self.model.glu
            kc.USED.add(f"triton:grouped_{arg.format}")
            return grouped_glu(z, None, r.weights, arg, ACT_SITU, float(beta), float(lbeta), plan=plan)
        return moe_dispatch(z, r.ids, r.weights, L, _Listed(arg), self.model._expert, self.model.glu)

    # ------------------------------------------------------------------ the host step between stages

    def _decide(self, L: int, r, guessed: int | None = None) -> None:
        """The layer's one host synchronisation: fetch the chosen experts and write their slab slots; a guess of
        MoE layer ``guessed``'s experts goes to the source first, to be read behind this layer's."""
        if self.ids_ready is not None:
            self.ids_ready.synchronize()  # the ids copy is done; the side stage may still be running
        chosen = self.ids_host[L].tolist()  # [[k ids]]
        wanted = sorted({e for row in chosen for e in row})
        if guessed is not None:
            self.experts.guess(guessed, sorted(set(self.guess_host[guessed].tolist()[0])))
        got = list(self.experts.fetch(L, wanted))
        assert len(got) == len(wanted), f"expert source returned {len(got)} of {len(wanted)} experts"
        slab = getattr(self.experts, "slab", None)
        slot = {e: slab.slot_of(t) for e, t in got} if slab is not None else {}
        if len(chosen) != 1 or len(wanted) != self.k or not kc.enabled(r.x):
            self.decided[L] = ("fetched", got)
            return
        if slab is None or None in slot.values():  # views of a slab are of a kernel format by construction
            if not all(kc.grouped_eligible(r.x, t) for _, t in got):
                self.decided[L] = ("fetched", got)
                return
            slab, slot = self._stage(got), {e: s for s, (e, _) in enumerate(got)}
        self.blk_np[L][:] = [slot[e] for e in chosen[0]]
        self.blk[L].copy_(self.blk_host[L], non_blocking=True)  # read by this layer's launch, stream-ordered
        self.decided[L] = ("plan", slab)

    def _resident(self, L: int, r=None) -> torch.Tensor | None:
        """MoE layer L's slot table where the source keeps every expert of it in its slab for good
        (``resident_slots``) and the layer's launch can take its slots from there (the kernels on, one token):
        [E] int32 on the device, else None."""
        slots = getattr(self.experts, "resident_slots", None)
        if slots is None or (r is not None and not kc.enabled(r.x)):
            return None
        return slots(L)

    def _look_up(self, L: int, r, table: torch.Tensor) -> None:
        """A resident layer's slots found on the device (the slab slot of each routed expert, in routing
        order): no host synchronisation, so the host queues the next stages while the GPU runs."""
        torch.index_select(table, 0, r.ids.view(-1), out=self.blk[L])
        self.experts.served_resident(L, self.k)
        self.decided[L] = ("plan", self.experts.slab)

    def _stage(self, got: list):
        """A slab of k slots holding copies of ``got`` (experts the source keeps outside its slab)."""
        from deltafin.kernels.triton_moe import ExpertSlab

        if self.staging is None or not self.staging.fits(got[0][1]):
            self.staging = ExpertSlab(self.k, got[0][1], self.model.device)
        for s, (_, t) in enumerate(got):
            self.staging.write(s, t)
        return self.staging

    # ------------------------------------------------------------------ the sequence state

    def _bind(self, state: SequenceState) -> None:
        """Make ``state``'s layers point at the runner's buffers (copying its contents in); the state that
        was bound before gets copies of its own back."""
        old = self._owner() if self._owner is not None else None
        if old is not None and old is not state:
            self._release(old)
        for i, st in enumerate(state.layers):
            if isinstance(st, KDAState):
                buf = self._kda.get(i)
                if buf is None:
                    buf = self._kda[i] = KDAState(torch.zeros_like(st.conv), torch.zeros_like(st.S))
                for name in ("conv", "S"):
                    if getattr(st, name) is not getattr(buf, name):
                        getattr(buf, name).copy_(getattr(st, name))
                        setattr(st, name, getattr(buf, name))
            elif isinstance(st, GrowingCache):
                buf = self._mla.get(i)
                if buf is None or buf.shape[0] < st.max_len:
                    if buf is not None:  # a longer context than the recorded graphs attend over
                        self._reset_graphs()
                    buf = self._mla[i] = st.buf.new_zeros((st.max_len, *st.row))  # finite past every length
                if st.buf is not buf:
                    buf[: st.length].copy_(st.buf[: st.length])
                    st.buf = buf
        self._owner = weakref.ref(state)
        self._state = state

    def _release(self, old: SequenceState) -> None:
        for i, st in enumerate(old.layers):
            if isinstance(st, KDAState) and i in self._kda:
                for name in ("conv", "S"):
                    if getattr(st, name) is getattr(self._kda[i], name):
                        setattr(st, name, getattr(st, name).clone())
            elif isinstance(st, GrowingCache) and st.buf is self._mla.get(i):
                st.buf = st.buf.clone()

    # ------------------------------------------------------------------ one step

    def step(self, ids: torch.Tensor, state: SequenceState) -> torch.Tensor:
        """Advance ``state`` by the one token ``ids`` [1]; returns its logits [1, V] float32."""
        for st in state.layers:
            if isinstance(st, GrowingCache) and state.pos + 1 > st.max_len:
                raise ValueError(f"MLA cache holds {st.max_len} tokens; cannot add 1 at position {state.pos}; "
                                 f"create the state with a larger max_len")
        self._bind(state)
        warm = self.capture and self.steps == 0
        if warm:  # the first step runs eagerly on the capture stream (Triton compiles, cuBLAS sets up there)
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                logits = self._step(ids, state)
            torch.cuda.current_stream().wait_stream(self.stream)
            torch.cuda.synchronize()
        else:
            logits = self._step(ids, state)
        state.pos += 1
        for st in state.layers:
            if isinstance(st, GrowingCache):
                st.length = state.pos
        self.steps += 1
        return logits

    def _step(self, ids: torch.Tensor, state: SequenceState) -> torch.Tensor:
        self.ids.copy_(ids.reshape(1))
        self.at.fill_(state.pos)
        state.at = self.at
        try:
            out = self._run(0, None)
            for j, L in enumerate(self.moe):
                nxt = self.moe[j + 1] if j + 1 < len(self.moe) else None
                table = self._resident(L, out[1])
                guessed = nxt if nxt is not None and self._resident(nxt) is None \
                    and self._guess(j, nxt, out[0]) else None
                if self.ids_ready is not None and table is None:
                    self.ids_ready.record()
                side = self._run(2 * j + 1, out)
                if table is None:
                    self._decide(L, out[1], guessed)
                else:
                    self._look_up(L, out[1], table)
                if self.mark is not None:
                    self.mark()
                out = self._run(2 * j + 2, (out, side))
        finally:
            state.at = None
        if self.graphs[0] is not None:
            kc.USED.add("cuda:graphs")
        return out.clone()
