"""The engine: a packed model's trunk resident, its routed experts streamed, tokens generated."""

from __future__ import annotations

import copy
import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from deltafin import kernels
from deltafin.errors import ReadError, UsageError
from deltafin.io.direct import FileDriveReader
from deltafin.models import registry
from deltafin.models.base import SequenceState
from deltafin.quant.record import QTensor
from deltafin.runtime import host_memory
from deltafin.runtime.batch import forward_batch
from deltafin.runtime.cluster import world_from_env
from deltafin.runtime.offload import SplitExperts, SplitModel, cuda_index
from deltafin.runtime.prefill_plan import default_context, plan_prefill
from deltafin.runtime.sampling import Sampler, SamplingParams
from deltafin.runtime.source import StreamingExperts
from deltafin.runtime.stats import RunStats
from deltafin.runtime.stops import StopMatcher
from deltafin.store.model_dir import PackedModel

log = logging.getLogger(__name__)
GB = 1e9
PREFILL_PROGRESS_TOKENS = 64  # shorter prompts are prefilled too fast for a progress bar to help
GREEDY = SamplingParams()


@dataclass(frozen=True, slots=True)
class EngineOptions:
    device: str = "cpu"
    cache_gb: float | None = None  # None: derived from free memory and trunk size
    threads: int = 4  # reader threads per drive
    verify_reads: bool = True  # every expert read checked against its checksum (in the reader threads)
    verify_on: str = "auto"  # where: "gpu" (in the slab slots, two launches a layer), "host", "auto" (gpu on CUDA)
    drive_map: dict | None = None
    emulate_drives: str | None = None
    max_len: int | None = 4096  # None: the model's max_position_embeddings, lowered to what free memory holds
    prefill_gb: float | None = None  # None: a quarter of available memory, at least 1 GB
    record_routes: str | None = None  # write the routing trace (JSONL, deltafin.io.routes) of decoded tokens here
    read_deadline_s: float | None = None  # least seconds a read may take before it is retried (ReadDeadline)
    dist_timeout_s: float = 120.0  # a collective or an idle leader's silence longer than this stops a cluster run
    dist_routing: str = "check"  # ranks route alike by the same trunk math (checked), or take rank 0's (broadcast)
    progress: bool = False  # progress with ETA on stderr for the trunk load and long prefills (the CLI's)
    exact: bool = False  # False: fused kernels (the CLI's default); True: the float32 plain-torch reference
    dtype: str = "auto"  # activations on the fast path: auto, bf16 or f32 (ignored when exact)
    batch_invariant: bool = False  # each sequence's logits independent of the others batched with it (CPU, CUDA)
    cuda_graphs: bool = True  # Kimi K3 bf16 decode on CUDA replays CUDA graphs (also off: DELTAFIN_CUDA_GRAPHS=0)
    adapt_threads: bool = True  # CPU fast path: one-token steps take the thread count that measures fastest
    gpu_layers: int | None = None  # CUDA: the last N layers (and the head) on the GPU, the rest on the CPU
    gpu_memory_gb: float | None = None  # CUDA: the most GPU memory the engine uses (trunk, expert cache, working)
    warmup: bool = True  # CUDA: every kernel loaded at open by a throwaway pass (runtime/warmup.py)
    guess_next: bool = True  # decode reads each next layer's likely experts while a layer runs (source.guess)


def _guesses(src) -> tuple[int, int, int]:
    """(experts read ahead on a guess, of them used, cancelled unread) so far, of a source that guesses."""
    return getattr(src, "guessed", 0), getattr(src, "guess_used", 0), getattr(src, "guess_cancelled", 0)


CUDA_HEADROOM = 2 << 30  # beside the trunk: activations, the KV/latent caches' first blocks, the kernels' workspaces


def gpu_budget(device: torch.device, cap_gb: float | None) -> tuple[int, bool]:
    """(bytes the engine may place on the GPU, whether --gpu-memory-gb set them): the memory free on the device,
    or the cap when it is smaller."""
    free, _ = torch.cuda.mem_get_info(device)
    return (free, False) if cap_gb is None else (min(int(cap_gb * GB), free), True)


def plan_gpu(packed: PackedModel, device: torch.device, opts: EngineOptions):
    """Which trunk layers go to the GPU (``runtime/offload_plan.py``), from the manifest, before the trunk loads;
    a request that cannot be met is refused naming the option."""
    from deltafin.runtime.offload_plan import TrunkSizes, plan_offload

    sizes = TrunkSizes.from_manifest(packed.doc["trunk"]["tensors"], int(packed.text_config["num_hidden_layers"]))
    budget, _ = gpu_budget(device, opts.gpu_memory_gb)
    return plan_offload(sizes, budget, CUDA_HEADROOM, opts.gpu_layers, opts.gpu_memory_gb, str(device))


def default_cache_bytes(trunk_bytes: int, device: torch.device | None = None) -> int:
    """Half of what is left after the trunk and 2 GB of headroom: of available RAM on the CPU, of free
    device memory on CUDA (where cached experts live on the GPU)."""
    if device is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = host_memory.available_bytes()
    return max(int((free - trunk_bytes - 2 * 1024**3) * 0.5), 0)


def default_prefill_bytes() -> int:
    return max(int(host_memory.available_bytes() * 0.25), 1 << 30)


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
        run = {k: d.get(k, 0) - b.get(k, 0) for k in ("reads", "bytes", "busy_s", "errors", "active_s", "check_s")}
        run["gbps_over_run"] = run["bytes"] / wall_s / 1e9 if wall_s > 0 else 0.0
        run["gbps_busy"] = run["bytes"] / run["active_s"] / 1e9 if run["active_s"] > 0 else 0.0  # while reading
        out[label] = run
    return out


def own_drives(model_dir: str, rank: int) -> set[str] | None:
    """The drive labels rank ``rank`` reads: its own under the manifest's ownership, else every drive (None)."""
    from deltafin.store.manifest import load

    rk = load(model_dir)["experts"].get("ranks")
    return None if rk is None or rank >= rk["world"] else set(rk["ranks"][rank]["drives"])


class ForeignDrive:
    """A drive of another rank: this rank never reads it (its experts are owned elsewhere)."""

    direct = True
    reads = False  # no read buffers to keep for it (StreamingExperts.reserve_buffers)

    def __init__(self, label: str):
        self.label = label

    def read_into(self, path: str, offset: int, buf: memoryview) -> int:
        raise ReadError(f"drive {self.label} belongs to another rank; {path} is not this rank's to read (the "
                        f"manifest's ownership and its drives disagree: re-run 'deltafin place --ranks')")


DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def compute_dtype(exact: bool, dtype: str, device: torch.device) -> torch.dtype:
    """float32 on the exact path; ``auto`` is bf16 on CUDA and float32 on the CPU, where the fused kernels
    accumulate in float32 either way and bf16 activations only add conversions (`deltafin bench warm`)."""
    if dtype not in ("auto", *DTYPES):
        raise UsageError(f"--dtype {dtype!r} is not a compute dtype; choose auto, bf16 or f32")
    if exact:
        return torch.float32
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


WIDEN_ELEMENTS = 1 << 21  # 16-bit records up to this size (norms, routers) are kept in float32 on the CPU


def widen_small(weights: dict[str, QTensor]) -> dict[str, QTensor]:
    """Small bf16/f16 records as float32 records (exact: every 16-bit float is a float32): a float32 step
    otherwise converts each norm weight and router matrix on every use, a copy per layer per token (a router of
    128 x 2048: 1 MB a layer). Larger ones keep their 16 bits (memory)."""
    return {k: QTensor("f32", w.shape, w.data.float()) if isinstance(w, QTensor) and w.format in ("bf16", "f16")
            and w.data.numel() <= WIDEN_ELEMENTS else w for k, w in weights.items()}


def resolve_device(name: str) -> torch.device:
    if name == "mlx":  # MLX runs the step (deltafin/mlx); torch only carries ids in and logits out, on the host
        return torch.device("cpu")
    if name == "auto":  # as the other local runners do: the GPU when there is one
        return torch.device("cuda" if torch.cuda.is_available() else
                            "mps" if torch.backends.mps.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available to torch here; use --device cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UsageError("--device mps: the Apple GPU is not available to torch here; use --device cpu")
    if name not in ("cpu", "cuda", "mps"):
        raise UsageError(f"--device {name!r} is not a device Deltafin runs on; choose auto, cpu, cuda, mps or mlx")
    return torch.device(name)


def _deadline(seconds: float | None):
    from deltafin.io.pool import ReadDeadline

    if seconds is None:
        return ReadDeadline()
    if not (seconds > 0 and seconds != float("inf")):
        raise UsageError(f"--read-deadline {seconds}: give seconds > 0, e.g. --read-deadline 10")
    return ReadDeadline(min_s=seconds)


class Engine:
    def __init__(self, model_dir: str, opts: EngineOptions = EngineOptions()):
        from deltafin.mlx.engine import default_here

        self.mlx = opts.device == "mlx" or (opts.device == "auto" and default_here())
        self.opts = opts = replace(opts, device="mlx") if self.mlx else opts
        self.device = resolve_device(opts.device)
        if opts.batch_invariant and (self.device.type not in ("cpu", "cuda") or self.mlx):
            where = "mlx" if self.mlx else self.device.type
            raise UsageError(f"--batch-invariant is built for the CPU and CUDA; on {where} a sequence's logits can "
                             f"depend on what is batched with it: drop --batch-invariant or use --device cpu")
        self.cluster = self.dist = None
        if world_from_env() > 1:  # launched by torchrun: this rank computes its share of the experts
            if opts.record_routes:
                raise UsageError("--record-routes records one process's routes; run it without torchrun")
            from deltafin.runtime import cluster

            self.cluster = cluster.init(self.device, opts.dist_timeout_s)
            self.device = self.cluster.device
            try:
                self._open(model_dir, opts)
            except BaseException as e:  # the other ranks are waiting for this one: tell them why it left
                self.cluster.record_error(e)
                raise
        else:
            self._open(model_dir, opts)

    def _open(self, model_dir: str, opts: EngineOptions) -> None:
        if self.device.type == "cpu":
            from deltafin.runtime.host_memory import keep_freed_memory

            keep_freed_memory()  # a CPU forward's large temporaries reuse freed blocks (see host_memory)
        own = None if self.cluster is None else own_drives(model_dir, self.cluster.rank)
        self.packed = PackedModel.open(model_dir, opts.drive_map, only=own)
        if self.mlx:
            from deltafin.mlx.engine import check

            check(self.packed)
        trunk_bytes = int(self.packed.doc["trunk"]["bytes"])
        self.offload = None  # on CUDA, which layers the GPU holds (OffloadPlan)
        if self.device.type == "cuda" and not self.mlx:
            self._place_layers()
            if self.offload.split:
                self._open_split(opts, own)
                self._open_rest(opts)
                return
        elif opts.gpu_memory_gb is not None or opts.gpu_layers:
            flag = "--gpu-memory-gb" if opts.gpu_memory_gb is not None else "--gpu-layers"
            raise UsageError(f"{flag}: the trunk is split between a CUDA GPU and the CPU, and this run is on "
                             f"{'mlx' if self.mlx else self.device.type} (--device {opts.device}); use --device cuda "
                             f"on a machine with a CUDA GPU, or drop {flag}")
        self.cache_bytes = self._cache_bytes(trunk_bytes)
        from deltafin.progress import bar

        with bar(trunk_bytes, "loading trunk", enabled=opts.progress) as b:
            weights = {k: v.to(self.device) for k, v in self.packed.trunk_records(b.update).items()}
        self.dtype = compute_dtype(opts.exact, opts.dtype, self.device)
        if self.device.type == "cpu" and self.dtype == torch.float32:
            weights = widen_small(weights)
        if self.mlx:  # the MLX engine's model and slab-backed source (deltafin/mlx/engine.py)
            from deltafin.mlx.engine import open_mlx

            self.model, self.source = open_mlx(self.packed, weights, opts.exact, opts.dtype, self.cache_bytes, opts.threads, None,
                                               opts.verify_reads, _deadline(opts.read_deadline_s))
            del weights
            self._open_rest(opts)
            return
        self.model = registry.build(self.packed.family, self.packed.text_config, weights, self.device, self.dtype)
        del weights  # the model holds the records now; stacking below then frees the originals it replaces
        stack = getattr(self.model, "stack_decode_projections", None)
        if stack is not None and self.device.type == "cuda" and self.dtype == torch.bfloat16:
            stack()  # same-input int8 projections as one GEMV each in a one-token step
        readers = None
        if opts.emulate_drives:
            from deltafin.io.emulator import emulated_readers

            readers = emulated_readers(opts.emulate_drives, self.packed)
        elif own is not None:
            readers = [FileDriveReader(d.label, d.path) if d.label in own else ForeignDrive(d.label)
                       for d in self.packed.drives]
        self.source = StreamingExperts(self.packed, self.cache_bytes, opts.threads, self.device, readers,
                                       opts.verify_reads, deadline=_deadline(opts.read_deadline_s),
                                       verify_on=opts.verify_on, guess_next=opts.guess_next)
        self._open_rest(opts)

    def _place_layers(self) -> None:
        """The offload plan on CUDA, and the memory cap enforced; every layer on the CPU (0) runs the CPU path."""
        if self.cluster is not None and (self.opts.gpu_layers is not None or self.opts.gpu_memory_gb is not None):
            raise UsageError("--gpu-layers/--gpu-memory-gb: a torchrun rank keeps its whole trunk on its GPU; run "
                             "without them under torchrun")
        self.gpu = self.device
        self.offload = plan_gpu(self.packed, self.device, self.opts)
        if self.cluster is not None and not self.offload.all_gpu:
            from deltafin import fmt

            free, total = torch.cuda.mem_get_info(self.device)
            raise UsageError(f"the trunk ({fmt.size(self.packed.doc['trunk']['bytes'])}) and {fmt.size(CUDA_HEADROOM)} "
                             f"of working memory do not fit the {fmt.size(free)} free on {self.device} "
                             f"({fmt.size(total)} in all), and a torchrun rank keeps its whole trunk on its GPU: run "
                             f"on GPUs with more memory, with --device cpu, or as one process (--gpu-layers)")
        if self.opts.gpu_memory_gb is not None:  # the caching allocator refuses to grow past the cap
            _, total = torch.cuda.mem_get_info(self.device)
            fraction = min(self.opts.gpu_memory_gb * GB / total, 1.0)
            torch.cuda.set_per_process_memory_fraction(fraction, cuda_index(self.device))
        if self.offload.gpu_layers == 0:
            if self.opts.gpu_layers is None:
                log.warning("%s has too little free memory for the head and one layer beside %s of working memory: "
                            "every layer runs on the CPU", self.device, f"{CUDA_HEADROOM / GB:.2f} GB")
            self.device = torch.device("cpu")

    def _open_split(self, opts: EngineOptions, own) -> None:
        """The trunk's first layers on the CPU, the rest and the head on the GPU (``runtime/offload.py``); each
        side streams its layers' experts into its own cache."""
        from deltafin.progress import bar
        from deltafin.runtime import offload

        assert own is None and self.cluster is None, "a torchrun rank keeps its whole trunk on its GPU"
        plan, gpu, cpu = self.offload, self.device, torch.device("cpu")
        self.dtype = compute_dtype(opts.exact, opts.dtype, gpu)
        cpu_dtype = compute_dtype(opts.exact, opts.dtype, cpu)
        with bar(int(self.packed.doc["trunk"]["bytes"]), "loading trunk", enabled=opts.progress) as b:
            records = self.packed.trunk_records(b.update)
        self.model = offload.build_split(self.packed.family, self.packed.text_config, records, plan, gpu, cpu_dtype,
                                         self.dtype, widen_small if cpu_dtype == torch.float32 else None)
        del records
        if self.dtype == torch.bfloat16:
            self.model.stack_decode_projections()
        if opts.emulate_drives:
            from deltafin.io.emulator import emulated_readers

            readers = emulated_readers(opts.emulate_drives, self.packed)
        else:
            readers = [FileDriveReader(d.label, d.path) for d in self.packed.drives]
        host, on_gpu = self._split_cache_bytes()
        deadline = _deadline(opts.read_deadline_s)
        sources = [StreamingExperts(self.packed, n, opts.threads, dev, readers, opts.verify_reads, deadline=deadline,
                                    verify_on=where, guess_next=opts.guess_next)
                   for n, dev, where in ((host, cpu, "auto" if opts.verify_on == "gpu" else opts.verify_on),
                                         (on_gpu, gpu, opts.verify_on))]
        self.source = offload.SplitExperts(*sources, plan.first_gpu)
        self.cache_bytes = host + on_gpu

    def _split_cache_bytes(self) -> tuple[int, int]:
        """(host, GPU) expert cache budgets of a split trunk: --cache-gb shared in proportion to the MoE layers on
        each side; by default half of the GPU budget left after its layers and the working memory, and half of
        the RAM left after the CPU's layers."""
        from deltafin.runtime.offload_plan import split_cache

        plan = self.offload
        if self.opts.cache_gb is not None:
            on_gpu, host = split_cache(int(self.opts.cache_gb * GB), self.packed.moe_layers, plan)
            return host, on_gpu
        budget, _ = gpu_budget(self.device, self.opts.gpu_memory_gb)
        on_gpu = max(int((budget - plan.gpu_bytes - CUDA_HEADROOM) * 0.5), 0)
        return default_cache_bytes(plan.cpu_bytes), on_gpu

    def _open_rest(self, opts: EngineOptions) -> None:
        from deltafin.runtime.tokenizer import load_codec

        self.codec = load_codec(self.packed.path, self.packed.config)
        self.prefill_bytes = int(opts.prefill_gb * GB) if opts.prefill_gb is not None else default_prefill_bytes()
        self.context_reason = "given"
        if opts.max_len is None:
            n, self.context_reason = default_context(self.packed.text_config, self._state_budget())
            self.opts = opts = replace(opts, max_len=n)
        self.routes = None
        self._on_layer = None  # prefill progress, called after each layer
        self._graphs = None  # the CUDA-graph decode runner once made (False: graphs do not apply)
        self.threads = None  # the decode steps' thread policy, where the count cannot change a result
        if (opts.adapt_threads and self.device.type == "cpu" and not self.mlx and not opts.exact
                and self.cluster is None and torch.get_num_threads() > 1):
            from deltafin.runtime.threads import ThreadPolicy

            self.threads = ThreadPolicy(torch.get_num_threads())
        if opts.record_routes:
            self.record_routes(opts.record_routes)
        self.warm_s = None  # seconds the kernels' warmup took, where it ran
        if opts.warmup and self.device.type == "cuda" and not self.mlx and self.cluster is None:
            from deltafin.runtime import warmup

            try:
                self.warm_s = warmup.warm(self)
            except BaseException:  # e.g. a bad expert with no good copy, met at open: its reader threads go too
                self.close()
                raise
        if self.cluster is not None:  # last: every rank is ready to follow once this returns
            self._join_cluster()

    def _cache_bytes(self, trunk_bytes: int) -> int:
        """--cache-gb; on a cluster rank without it, the rank's budget from the manifest's ownership; else
        half of what is free after the trunk (in RAM shared by the ranks of this machine)."""
        if self.opts.cache_gb is not None:
            return int(self.opts.cache_gb * GB)
        if self.device.type == "cuda" and self.opts.gpu_memory_gb is not None:  # half of what the cap leaves
            budget, _ = gpu_budget(self.device, self.opts.gpu_memory_gb)
            return max(int((budget - trunk_bytes - CUDA_HEADROOM) * 0.5), 0)
        if self.cluster is not None:
            rk = self.packed.doc["experts"].get("ranks")
            if rk is not None and rk["ranks"][self.cluster.rank]["cache_gb"] > 0:
                return int(rk["ranks"][self.cluster.rank]["cache_gb"] * GB)
            share = 1 if self.device.type == "cuda" else self.cluster.local_world  # each GPU has its own memory
            return default_cache_bytes(trunk_bytes, self.device) // share
        return default_cache_bytes(trunk_bytes, self.device)

    def _join_cluster(self) -> None:
        from deltafin.runtime import distributed as dd

        cl = self.cluster
        assert not isinstance(self.source, dd.DistributedExperts), "an engine joins its cluster once"
        owners = dd.owners_from_manifest(self.packed.doc, cl.world)
        digest = hashlib.sha256(repr(sorted(owners.items())).encode()).hexdigest()[:16]
        cl.join("model, ownership digest, routing mode and context",
                repr((self.packed.model_id, digest, self.opts.dist_routing, self.opts.max_len)))
        self.source = dd.DistributedExperts(self.source, cl, owners, self.opts.dist_routing)
        self.dist = dd.Leader(cl) if cl.leader else None

    def follow(self) -> None:
        """A follower rank's whole job: run the leader's steps until it stops."""
        from deltafin.runtime.distributed import follow

        follow(self, self.rank_stats)

    def rank_stats(self) -> dict:
        """This rank's reads and collective time (cumulative), for the leader's summary and the benchmark."""
        s, c = self.source.stats, getattr(self.source, "comm", None)
        return {"rank": 0 if self.cluster is None else self.cluster.rank, "bytes_read": s.bytes_read,
                "reads": s.reads, "io_wait_s": s.io_wait_s, "expert_math_s": s.expert_math_s,
                "hit_rate": s.hit_rate, "collective_s": c.collective_s if c else 0.0,
                "collectives": c.collectives if c else 0, "per_drive": self.source.per_drive()}

    def cluster_stats(self) -> list[dict]:
        """Every rank's ``rank_stats`` (the leader asks the followers); one entry without a cluster."""
        return [self.rank_stats()] if self.dist is None else self.dist.stats(self.rank_stats())
    def _state_budget(self) -> int:
        """Half of the memory left for sequence state once the expert cache is full, on the state's device (a split
        trunk: the GPU's, beside its own cache, under --gpu-memory-gb)."""
        cache = self.cache_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if self.opts.gpu_memory_gb is not None:
                free = min(free, int(self.opts.gpu_memory_gb * GB) - torch.cuda.memory_reserved(self.device))
            if isinstance(self.source, SplitExperts):
                cache = self.source.cache_bytes[1]
        else:
            free = host_memory.available_bytes()
        return max(int((free - cache) * 0.5), 0)

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

    def math(self):
        """The compute path for model calls made in this block (``kernels.math``): fused kernels unless the options
        say exact, on the CPU with denormals flushed."""
        split = self.offload is not None and self.offload.split  # the CPU's layers run the CPU's fast path
        return kernels.math(self.opts.exact, "cpu" if split else self.device.type, self.opts.batch_invariant)

    @property
    def device_label(self) -> str:
        """The device the step runs on, for start lines and stats ('mlx' for the MLX engine, 'cuda:0 + cpu' for a
        trunk split between them)."""
        if self.offload is not None and self.offload.split:
            return f"{self.device} + cpu"
        return "mlx" if self.mlx else str(self.device)

    @property
    def math_name(self) -> str:
        if self.mlx:
            from deltafin.mlx.engine import device_name

            return f"{device_name()}, {'exact float32' if self.opts.exact else str(self.model.dtype).rsplit('.', 1)[-1]} activations"
        if self.opts.exact:
            return "exact float32 reference (plain torch)"
        if self.offload is not None and self.offload.split:
            from deltafin.kernels import cpu

            low = str(self.model.low.dtype).removeprefix("torch.")
            return (f"fused kernels ({kernels.backend_name('cuda')} on the GPU's layers, "
                    f"{str(self.dtype).removeprefix('torch.')} activations; cpu, {cpu.isa()} on the CPU's, {low})")
        name = kernels.backend_name(self.device.type)
        if name == "cpu":
            from deltafin.kernels import cpu

            name = f"cpu, {cpu.isa()}"
        return f"fused kernels ({name}), {str(self.dtype).removeprefix('torch.')} activations"

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.codec.eos_ids if self.codec else ()

    def new_state(self, max_len: int | None = None) -> SequenceState:
        st = self.model.new_state(max_len or self.opts.max_len)
        if self.dist is not None:
            self.dist.new_state(st, max_len or self.opts.max_len)
        return st

    def copy_state(self, state: SequenceState) -> SequenceState:
        """An independent copy of a sequence's state (on a cluster, every rank copies its own)."""
        st = copy.deepcopy(state)
        if self.dist is not None:
            self.dist.copy_state(state, st)
        return st

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
        return [lg[-1] for lg in self.step(batch)]

    @torch.inference_mode()
    def step(self, batch: list[tuple[torch.Tensor, SequenceState]], all_logits: bool = False) -> list[torch.Tensor]:
        """One pass of sequences (ids [T_j], state) -> logits per sequence ([1, V], or [T_j, V]). The one place
        a pass runs: on a cluster's leader it is announced to the followers first, and they run it too."""
        if self.dist is None:
            return self.local_step(batch, all_logits)
        with self.dist.step([(ids.tolist(), st) for ids, st in batch], all_logits):
            return self.local_step(batch, all_logits)

    @torch.inference_mode()
    def local_step(self, batch: list[tuple[torch.Tensor, SequenceState]], all_logits: bool = False
                   ) -> list[torch.Tensor]:
        one_token = sum(int(ids.shape[0]) for ids, _ in batch) == 1
        if one_token and self.threads is not None:
            return self._threaded_step(batch, all_logits)
        return self._local_step(batch, all_logits, one_token)

    def _threaded_step(self, batch, all_logits: bool) -> list[torch.Tensor]:
        """A one-token step at the thread count the policy picks (runtime/threads.py), timed for it."""
        n = self.threads.next()
        torch.set_num_threads(n)
        io0, t0 = self.source.stats.io_wait_s, time.perf_counter()
        try:
            return self._local_step(batch, all_logits, True)
        finally:
            self.threads.done(n, time.perf_counter() - t0 - (self.source.stats.io_wait_s - io0))
            torch.set_num_threads(self.threads.most)

    def _local_step(self, batch, all_logits: bool, one_token: bool) -> list[torch.Tensor]:
        if self.routes is None or not one_token:
            with self.math():
                return self._pass(batch, all_logits, one_token)
        self.source.routes = []  # one token: each fetch is exactly its routed experts
        try:
            with self.math():
                out = self._pass(batch, all_logits, one_token)
            self.routes.write(self.source.routes)
        finally:
            self.source.routes = None
        return out

    def _pass(self, batch, all_logits: bool, one_token: bool) -> list[torch.Tensor]:
        """One decode token of one sequence replays the CUDA graphs where they apply; anything else (prefill,
        several sequences) takes the layer-by-layer path."""
        graphs = self._decode_graphs() if one_token else None
        if graphs is not None:
            (ids, st), = batch
            return [graphs.step(ids, st)]
        return forward_batch(self.model, batch, self.source, all_logits, on_layer=self._on_layer)

    def _decode_graphs(self):
        """The CUDA-graph decode runner (``runtime/cuda_graphs.py``), made at the first decode step; None
        where graphs do not apply (the reason is logged once)."""
        if self._graphs is None:
            from deltafin.runtime import cuda_graphs

            why = "turned off (EngineOptions.cuda_graphs)" if not self.opts.cuda_graphs else \
                "the trunk's layers are split between the GPU and the CPU" if isinstance(self.model, SplitModel) else \
                "--batch-invariant (the graphs replay the one-token kernels)" if self.opts.batch_invariant else \
                "a cluster rank exchanges expert results every layer" if self.cluster is not None else \
                cuda_graphs.why_not(self.model, self.source, self.device, self.dtype)
            if why is not None and self.device.type == "cuda":
                log.info("decode steps run without CUDA graphs: %s", why)
            self._graphs = False if why else cuda_graphs.DecodeGraphs(self.model, self.source)
        return self._graphs or None

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
        if self.opts.batch_invariant:  # chunk boundaries that never depend on the other prompts
            fixed = self._invariant_chunk()
            if len(prompts) > 1 and plan.chunk < min(fixed, longest):  # together they need smaller chunks
                return self._prefill_invariant(prompts, states)
            plan = replace(plan, chunk=fixed)
        src = self.source
        before, src.record = src.stats.bytes_read, []
        t0 = time.perf_counter()
        last: list[torch.Tensor | None] = [None] * len(prompts)
        from deltafin.progress import bar

        show = self.opts.progress and sum(map(len, prompts)) >= PREFILL_PROGRESS_TOKENS
        progress = bar(plan.chunks * self.model.num_layers, "prefill", unit="layer", enabled=show, leave=False)
        self._on_layer = progress.update if show else None
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
            self._on_layer = None
            progress.close()
        unique = sum(len(u) * self.packed.file_bytes(L) for L, u in unions.items())
        report = PrefillReport(sum(map(len, prompts)), plan.chunk, time.perf_counter() - t0,
                               src.stats.bytes_read - before, unique, {L: len(u) for L, u in sorted(unions.items())})
        return last, report

    def _invariant_chunk(self) -> int:
        """The prefill chunk of a batch-invariant run: what one sequence of the full context limit takes, so chunk
        boundaries (and with them each token's attention sums) never depend on the other prompts."""
        return plan_prefill(self.packed.text_config, self.opts.max_len, 0, self.prefill_bytes, 1).chunk

    def _prefill_invariant(self, prompts: list[list[int]], states: list[SequenceState]
                           ) -> tuple[list[torch.Tensor], PrefillReport]:
        """Prompts one at a time (each in the chunks it takes alone), the reports summed."""
        outs, reports = [], []
        for p, st in zip(prompts, states, strict=True):
            (lg,), rep = self.prefill([p], [st])
            outs.append(lg)
            reports.append(rep)
        unions: dict[int, int] = {}
        for r in reports:
            for L, n in r.union_per_layer.items():
                unions[L] = max(unions.get(L, 0), n)
        return outs, PrefillReport(sum(r.tokens for r in reports), reports[0].chunk, sum(r.seconds for r in reports),
                                   sum(r.bytes_read for r in reports), sum(r.unique_bytes for r in reports), unions)

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
        stats = self.last_stats = RunStats(prompt_tokens=len(prompt), device=self.device_label,
                                           cache_bytes=self.cache_bytes, direct_io=self.source.direct,
                                           mapped_drives=len(getattr(self.source, "mapped", [])))
        stop_ids = self.eos_ids if stop_ids is None else stop_ids
        state = state if state is not None else self.new_state()
        sampler = Sampler(sampling, prompt)
        self._settle_clock()
        src = self.source.stats
        base = (src.io_wait_s, src.expert_math_s, src.bytes_read, src.reads, src.hits, src.misses,
                self.source.per_drive(), getattr(src, "gpu_check_s", 0.0), _guesses(src), getattr(src, "checked_later", 0))
        t0 = time.perf_counter()
        (logits,), pre = self.prefill([prompt], [state])
        stats.prefill_read_amplification = pre.read_amplification
        stats.prefill_chunk = pre.chunk
        stats.union_per_layer = pre.union_per_layer
        stats.prefill_bytes_read = pre.bytes_read
        emitted, text = [], ""
        stops = StopMatcher(stop_strings)
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
            at = stops.feed(text)
            if at is not None:
                hit = next(s for s in stops.stops if text.startswith(s, at))
                text = text[:at]
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

    def _settle_clock(self) -> None:
        """CUDA: the source's GPU-clock times resolved (one device synchronisation, between runs)."""
        settle = getattr(self.source, "settle_clock", None)
        if settle is not None:
            settle()

    def _finish(self, stats: RunStats, emitted, text, t0, t_first, base) -> None:
        self._settle_clock()
        end = time.perf_counter()
        if getattr(self.source, "settle_clock", None) is not None and self.device.type == "cuda":
            stats.clock = "gpu+graphs" if self._graphs else "gpu"
        src = self.source.stats
        stats.tokens = emitted
        stats.kernels = kernels.used()
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
        stats.checks = getattr(self.source, "checks_where", "host")
        stats.check_s = sum(d["check_s"] for d in stats.per_drive.values())
        stats.gpu_check_s = getattr(src, "gpu_check_s", 0.0) - base[7]
        stats.checked_later = getattr(src, "checked_later", 0) - base[9]
        stats.guessed, stats.guess_used, stats.guess_cancelled = (a - b for a, b in zip(_guesses(src), base[8],
                                                                                          strict=True))
        stats.guess_note = getattr(self.source, "guess_note", "")

    def close(self) -> None:
        if self.dist is not None:
            self.dist.close()
        self.record_routes(None)
        self.source.close()
        if self.opts.gpu_memory_gb is not None and self.offload is not None:  # the cap was this engine's
            torch.cuda.set_per_process_memory_fraction(1.0, cuda_index(self.gpu))
