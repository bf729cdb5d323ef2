"""The engine: a packed model's trunk resident, its routed experts streamed, tokens generated."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from deltafin.errors import UsageError
from deltafin.models import registry
from deltafin.models.base import SequenceState
from deltafin.runtime.batch import forward_batch
from deltafin.runtime.prefill_plan import plan_prefill
from deltafin.runtime.sampling import Sampler, SamplingParams
from deltafin.runtime.source import StreamingExperts
from deltafin.runtime.stats import RunStats
from deltafin.store.model_dir import PackedModel

log = logging.getLogger(__name__)
GB = 1e9
GREEDY = SamplingParams()


@dataclass(frozen=True, slots=True)
class EngineOptions:
    device: str = "cpu"
    cache_gb: float | None = None  # None: derived from free memory and trunk size
    threads: int = 4  # reader threads per drive
    verify_reads: bool = False
    drive_map: dict | None = None
    emulate_drives: str | None = None
    max_len: int = 4096
    prefill_gb: float | None = None  # None: a quarter of available memory, at least 1 GB
    record_routes: str | None = None  # write the routing trace (JSONL, deltafin.io.routes) of decoded tokens here


def default_cache_bytes(trunk_bytes: int, device: torch.device | None = None) -> int:
    """Half of what is left after the trunk and 2 GB of headroom: of available RAM on the CPU, of free
    device memory on CUDA (where cached experts live on the GPU)."""
    if device is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        import psutil

        free = psutil.virtual_memory().available
    return max(int((free - trunk_bytes - 2 * 1024**3) * 0.5), 0)


def default_prefill_bytes() -> int:
    import psutil

    return max(int(psutil.virtual_memory().available * 0.25), 1 << 30)


@dataclass
class PrefillReport:
    tokens: int
    chunk: int
    seconds: float
    bytes_read: int
    unique_bytes: int
    union_per_layer: dict[int, int]

    @property
    def read_amplification(self) -> float:
        return self.bytes_read / self.unique_bytes if self.unique_bytes else 0.0


def _drive_delta(now: dict[str, dict], before: dict[str, dict], wall_s: float) -> dict[str, dict]:
    """Per-drive counters of one run (the source's are cumulative), with the rate over the run's wall time."""
    out = {}
    for label, d in now.items():
        b = before.get(label, {})
        run = {k: d[k] - b.get(k, 0) for k in ("reads", "bytes", "busy_s", "errors")}
        run["gbps_over_run"] = run["bytes"] / wall_s / 1e9 if wall_s > 0 else 0.0
        out[label] = run
    return out


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available to torch here; use --device cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UsageError("--device mps: the Apple GPU is not available to torch here; use --device cpu")
    if name not in ("cpu", "cuda", "mps"):
        raise UsageError(f"--device {name!r} is not a device Deltafin runs on; choose cpu, cuda or mps")
    return torch.device(name)


class Engine:
    def __init__(self, model_dir: str, opts: EngineOptions = EngineOptions()):
        self.opts = opts
        self.device = resolve_device(opts.device)
        self.packed = PackedModel.open(model_dir, opts.drive_map)
        trunk_bytes = int(self.packed.doc["trunk"]["bytes"])
        self.cache_bytes = (int(opts.cache_gb * GB) if opts.cache_gb is not None
                            else default_cache_bytes(trunk_bytes, self.device))
        weights = {k: v.to(self.device) for k, v in self.packed.trunk_records().items()}
        self.model = registry.build(self.packed.family, self.packed.text_config, weights, self.device)
        readers = None
        if opts.emulate_drives:
            from deltafin.io.emulator import emulated_readers

            readers = emulated_readers(opts.emulate_drives, self.packed)
        self.source = StreamingExperts(self.packed, self.cache_bytes, opts.threads, self.device, readers,
                                       opts.verify_reads)
        from deltafin.runtime.tokenizer import load_codec

        self.codec = load_codec(self.packed.path, self.packed.config)
        self.prefill_bytes = int(opts.prefill_gb * GB) if opts.prefill_gb is not None else default_prefill_bytes()
        self.routes = None
        if opts.record_routes:
            self.record_routes(opts.record_routes)

    def record_routes(self, path: str | None):
        """Write the routes of every one-token forward pass (decode steps) to ``path`` as JSONL, or stop (None).

        A pass over several tokens fetches each layer's union of their experts, not per-token routes,
        so it is not recorded (the placement policies need which experts one token uses together).
        """
        from deltafin.io.routes import RouteWriter

        if self.routes is not None:
            self.routes.close()
        self.routes = None if path is None else RouteWriter(path, self.packed.model_id, self.packed.num_experts,
                                                            self.packed.moe_layers)
        return self.routes

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.codec.eos_ids if self.codec else ()

    def new_state(self, max_len: int | None = None) -> SequenceState:
        return self.model.new_state(max_len or self.opts.max_len)

    @torch.inference_mode()
    def forward(self, ids: list[int], state: SequenceState) -> torch.Tensor:
        """Run tokens of one sequence through the model (layer by layer over all of them) -> last logits [V]."""
        return self.forward_batch([(ids, state)])[0]

    @torch.inference_mode()
    def forward_batch(self, seqs: list[tuple[list[int], SequenceState]]) -> list[torch.Tensor]:
        """Several sequences in one pass: each routed expert is read once for all of their tokens."""
        for ids, state in seqs:
            if state.pos + len(ids) > self.opts.max_len:
                raise UsageError(f"{state.pos + len(ids)} tokens exceed the context limit of {self.opts.max_len}; "
                                 f"raise --max-len or shorten the prompt")
        batch = [(torch.tensor(ids, dtype=torch.long, device=self.device), st) for ids, st in seqs]
        if self.routes is None or sum(len(ids) for ids, _ in seqs) != 1:
            return [lg[-1] for lg in forward_batch(self.model, batch, self.source)]
        self.source.routes = []  # one token: each fetch is exactly its routed experts
        try:
            out = [lg[-1] for lg in forward_batch(self.model, batch, self.source)]
            self.routes.write(self.source.routes)
        finally:
            self.source.routes = None
        return out

    def prefill(self, prompts: list[list[int]], states: list[SequenceState]) -> tuple[list[torch.Tensor], PrefillReport]:
        """Prefill prompts together, expert-major, in chunks planned from the memory budget."""
        if any(not p for p in prompts):
            raise UsageError("a prompt is empty; give at least one token (a non-empty -p TEXT or --prompt-ids)")
        longest = max(len(p) for p in prompts)
        past = max(st.pos for st in states)
        for p, st in zip(prompts, states, strict=True):
            if st.pos + len(p) > self.opts.max_len:
                raise UsageError(f"{st.pos + len(p)} tokens exceed the context limit of {self.opts.max_len}; "
                                 f"raise --max-len or shorten the prompt")
        plan = plan_prefill(self.packed.text_config, longest, past, self.prefill_bytes, len(prompts))
        src = self.source
        before, src.record = src.stats.bytes_read, []
        t0 = time.perf_counter()
        last: list[torch.Tensor | None] = [None] * len(prompts)
        try:
            for start in range(0, longest, plan.chunk):
                live = [j for j, p in enumerate(prompts) if start < len(p)]
                out = self.forward_batch([(prompts[j][start : start + plan.chunk], states[j]) for j in live])
                for j, lg in zip(live, out, strict=True):
                    last[j] = lg
            unions: dict[int, set[int]] = {}
            for layer, ids in src.record:
                unions.setdefault(layer, set()).update(ids)
        finally:
            src.record = None
        unique = sum(len(u) * self.packed.file_bytes(L) for L, u in unions.items())
        report = PrefillReport(sum(map(len, prompts)), plan.chunk, time.perf_counter() - t0,
                               src.stats.bytes_read - before, unique, {L: len(u) for L, u in sorted(unions.items())})
        return last, report

    def generate(
        self,
        prompt: list[int],
        max_new: int,
        sampling: SamplingParams = GREEDY,
        stop_ids: tuple[int, ...] | None = None,
        stop_strings: tuple[str, ...] = (),
        state: SequenceState | None = None,
        on_logits: Callable[[torch.Tensor], None] | None = None,
    ) -> Iterator[tuple[int, str]]:
        """Yield (token id, text delta); fills ``self.last_stats``. ``state`` continues a conversation."""
        stats = self.last_stats = RunStats(prompt_tokens=len(prompt), device=str(self.device),
                                           cache_bytes=self.cache_bytes, direct_io=self.source.direct)
        stop_ids = self.eos_ids if stop_ids is None else stop_ids
        state = state if state is not None else self.new_state()
        sampler = Sampler(sampling)
        src = self.source.stats
        base = (src.io_wait_s, src.expert_math_s, src.bytes_read, src.reads, src.hits, src.misses,
                self.source.per_drive())
        t0 = time.perf_counter()
        (logits,), pre = self.prefill([prompt], [state])
        stats.prefill_read_amplification = pre.read_amplification
        stats.prefill_chunk = pre.chunk
        stats.union_per_layer = pre.union_per_layer
        stats.prefill_bytes_read = pre.bytes_read
        emitted, text = [], ""
        t_first = None
        while len(emitted) < max_new:
            if on_logits:
                on_logits(logits)
            tok = sampler(logits)
            if t_first is None:
                t_first = time.perf_counter()
                stats.ttft_s = t_first - t0
            emitted.append(tok)
            if tok in stop_ids:
                stats.stop_reason = "stop token"
                break
            delta = self._delta(emitted, text)
            text += delta
            yield tok, delta
            hit = next((s for s in stop_strings if s and s in text), None)
            if hit:
                text = text[: text.index(hit)]
                stats.stop_reason = f"stop string {hit!r}"
                break
            if len(emitted) < max_new:
                logits = self.forward([tok], state)
        else:
            stats.stop_reason = "max tokens"
        self._finish(stats, emitted, text, t0, t_first, base)

    def _delta(self, emitted: list[int], text: str) -> str:
        if self.codec is None:
            return ""
        full = self.codec.decode(emitted)
        return "" if full.endswith("\ufffd") else full[len(text):]  # hold back split UTF-8

    def _finish(self, stats: RunStats, emitted, text, t0, t_first, base) -> None:
        end = time.perf_counter()
        src = self.source.stats
        stats.tokens = emitted
        if self.device.type == "cuda":
            from deltafin.kernels import cuda as kc

            stats.kernels = sorted(kc.USED)
        stats.text = self.codec.decode([t for t in emitted if t not in self.eos_ids]) if self.codec else ""
        if "stop string" in stats.stop_reason:
            stats.text = text
        stats.prefill_tok_s = stats.prompt_tokens / max(stats.ttft_s, 1e-9)
        stats.decode_s = end - (t_first or end)
        stats.decode_tok_s = (len(emitted) - 1) / stats.decode_s if len(emitted) > 1 and stats.decode_s > 0 else 0.0
        stats.io_wait_s = src.io_wait_s - base[0]
        stats.expert_math_s = src.expert_math_s - base[1]
        stats.trunk_math_s = max(end - t0 - stats.io_wait_s - stats.expert_math_s, 0.0)
        stats.bytes_read = src.bytes_read - base[2]
        stats.reads = src.reads - base[3]
        hits, misses = src.hits - base[4], src.misses - base[5]
        stats.cache_hit_rate = hits / (hits + misses) if hits + misses else 0.0
        stats.per_drive = _drive_delta(self.source.per_drive(), base[6], end - t0)
        rated = {d.label: d.gbps for d in self.packed.drives}
        for label, d in stats.per_drive.items():
            d["rated_gbps"] = rated.get(label)

    def close(self) -> None:
        self.record_routes(None)
        self.source.close()
