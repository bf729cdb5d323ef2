"""``deltafin pull REPO OUT``: download a Hugging Face checkpoint through ``huggingface_hub`` and pack it as
its shards land.

The small files (config, index, tokenizer) come first, then every shard's safetensors header by a range
request, so the pack is planned before any weight arrives. The shards are then downloaded in the order the
packer reads them (layer by layer, the top-level tensors last) while ``pack`` runs: a read of a shard that
has not landed waits for it (``StreamedCheckpoint.shard_path``). Each shard is checked against the sha256
the Hub lists for it. With ``delete_source`` a shard is removed once every packed file made from it is
durable and has been read back against its checksum, and at most ``window`` shards are fetched ahead, so
the peak disk is the pack plus a few shards instead of the pack plus the whole checkpoint.

Interrupted anywhere, the same call resumes: huggingface_hub continues a cut download, the packer keeps
its finished files, and shards already packed and removed are not downloaded again (their headers are
kept in ``SRC/.deltafin-pull``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from deltafin.errors import CheckpointError, DeltafinError, UsageError
from deltafin.store.checkpoint import Checkpoint, TensorInfo
from deltafin.store.safetensors_io import read_header

log = logging.getLogger(__name__)
CONTROL = ".deltafin-pull"  # under the source folder: pull-state.json and the shards' headers
SIDE_FILES = ("config.json", "model.safetensors.index.json", "generation_config.json")
MAX_HEADER = 100 << 20


@dataclass(frozen=True, slots=True)
class PullOptions:
    revision: str | None = None  # branch, tag or commit (default: main)
    token: str | None = None  # default: huggingface_hub's own (HF_TOKEN, the saved login)
    source_dir: str | None = None  # where shards land (default: OUT/source)
    delete_source: bool = False
    window: int = 2  # shards fetched ahead of the packer with delete_source
    progress: bool = True


@dataclass
class PullSummary:
    repo_id: str
    commit: str
    shards: int
    downloaded: int  # shards fetched in this run
    removed: int  # shards removed after packing and read-back (all runs)
    source_bytes: int  # of every shard
    peak_source_bytes: int  # the most shard bytes on disk at once in this run
    pack: object = None  # PackSummary
    seconds: float = 0.0
    downloaded_names: list[str] = field(default_factory=list)


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None  # read per call: huggingface_hub reads it once at import


def _hub_error(repo_id: str, e: Exception) -> DeltafinError:
    """One line for what the Hub said, with the fix."""
    name = type(e).__name__
    if name in ("RepositoryNotFoundError", "GatedRepoError"):
        return UsageError(f"{repo_id}: no such repo on the Hub, or it is gated/private; check the name, accept its "
                          f"license on the Hub, and log in (hf auth login) or pass --token")
    if name == "RevisionNotFoundError":
        return UsageError(f"{repo_id}: no such revision; give a branch, tag or commit with --revision")
    return CheckpointError(f"{repo_id}: the Hub request failed ({name}: {str(e).splitlines()[0][:200]}); check the "
                           f"network (HF_ENDPOINT={_endpoint() or 'https://huggingface.co'}) and re-run to resume")


class Remote:
    """The repo at one commit: its file list (sizes, LFS sha256) and downloads into ``src``."""

    def __init__(self, repo_id: str, opts: PullOptions, src: str):
        from huggingface_hub import HfApi

        self.repo_id, self.opts, self.src = repo_id, opts, src
        self.api = HfApi(endpoint=_endpoint(), token=opts.token)
        try:
            self.commit = self.api.model_info(repo_id, revision=opts.revision).sha
            tree = list(self.api.list_repo_tree(repo_id, revision=self.commit, recursive=True))
        except Exception as e:  # huggingface_hub's HTTP errors, connection errors
            raise _hub_error(repo_id, e) from e
        self.files = {f.path: f for f in tree if hasattr(f, "size")}

    def sha256(self, name: str) -> str | None:
        lfs = getattr(self.files[name], "lfs", None)
        return getattr(lfs, "sha256", None) or (lfs.get("sha256") if isinstance(lfs, dict) else None)

    def download(self, name: str) -> str:
        from huggingface_hub import hf_hub_download

        kw = {} if self.opts.progress else {"tqdm_class": _Silent()}
        try:
            return hf_hub_download(self.repo_id, name, revision=self.commit, local_dir=self.src, token=self.opts.token,
                                   endpoint=_endpoint(), **kw)
        except Exception as e:
            raise _hub_error(self.repo_id, e) from e

    def header(self, name: str) -> bytes:
        """The first 8 bytes and the JSON header of a safetensors file, by range requests."""
        from huggingface_hub import get_session, hf_hub_url
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

        url = hf_hub_url(self.repo_id, name, revision=self.commit, endpoint=_endpoint())
        head = build_hf_headers(token=self.opts.token)

        def get(a: int, b: int) -> bytes:
            try:
                r = get_session().get(url, headers={**head, "Range": f"bytes={a}-{b}"}, follow_redirects=True)
                hf_raise_for_status(r)
            except Exception as e:
                raise _hub_error(self.repo_id, e) from e
            return r.content[: b - a + 1]

        first = get(0, 7)
        n = int.from_bytes(first, "little")
        if len(first) < 8 or n > min(MAX_HEADER, self.files[name].size - 8):
            raise CheckpointError(f"{self.repo_id}/{name}: not a safetensors file (header length {n:,}); the repo "
                                  f"is damaged or not a safetensors checkpoint")
        return first + get(8, 8 + n - 1)


def _Silent():
    from tqdm.auto import tqdm

    class Silent(tqdm):
        def __init__(self, *a, **k):
            k["disable"] = True
            super().__init__(*a, **k)

    return Silent


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


class StreamedCheckpoint(Checkpoint):
    """A checkpoint whose shards are still arriving: headers come from the pulled header files, and a read
    of a shard waits until it has landed (or downloads it again if it was removed and is needed)."""

    def __init__(self, path: str, feed: ShardFeed):
        self.feed = feed
        super().__init__(path)

    def has_shard(self, shard: str) -> bool:
        return shard in self.feed.shards or super().has_shard(shard)

    def _header(self, shard: str) -> dict[str, TensorInfo]:
        if shard not in self._headers and shard in self.feed.shards:
            entries, _, _ = read_header(self.feed.header_path(shard), CheckpointError, "re-run 'deltafin pull'")
            self._headers[shard] = {n: TensorInfo(n, shard, e.dtype, e.shape, e.offset, e.nbytes)
                                    for n, e in entries.items()}
        return super()._header(shard)

    def shard_path(self, shard: str) -> str:
        return self.feed.wait(shard) if shard in self.feed.shards else super().shard_path(shard)

    def source_identity(self) -> str:
        """What tells these weights apart from another checkpoint's (``ownership.source_identity``) without
        reading shards that have not landed: config.json and the Hub's sha256 of every shard."""
        h = hashlib.sha256()
        with open(os.path.join(self.path, "config.json"), "rb") as f:
            h.update(f.read(1 << 24))
        for shard in sorted(self.shards()):
            h.update(shard.encode() + b"\0" + (self.feed.remote.sha256(shard) or "").encode())
        return h.hexdigest()[:32]


class ShardFeed:
    """Downloads the shards in the packer's order in a thread; removes packed ones (``delete_source``)."""

    def __init__(self, remote: Remote, shards: list[str], opts: PullOptions, done_check=None):
        self.remote, self.shards, self.opts = remote, list(shards), opts
        self.src = remote.src
        self.control = os.path.join(self.src, CONTROL)
        os.makedirs(os.path.join(self.control, "headers"), exist_ok=True)
        self.state = self._load_state()
        self.done_check = done_check  # shard -> True once every packed file made from it is durable and read back
        self.cond = threading.Condition()
        self.collecting = threading.Lock()
        self.demand: set[str] = set()
        self.error: BaseException | None = None
        self.closed = False
        self.downloaded: list[str] = []
        self.peak = 0
        self.thread: threading.Thread | None = None

    # -- state --------------------------------------------------------------------------------------
    def _load_state(self) -> dict:
        p = os.path.join(self.control, "pull-state.json")
        st = {"repo": self.remote.repo_id, "commit": self.remote.commit, "landed": {}, "removed": []}
        if os.path.exists(p):
            with open(p) as f:
                old = json.load(f)
            if old.get("repo") == st["repo"] and old.get("commit") == st["commit"]:
                st = old
            else:
                log.warning("%s: the source folder held %s@%s; starting that record over", self.src,
                            old.get("repo"), str(old.get("commit"))[:12])
        return st

    def save(self) -> None:
        from deltafin.store.manifest import write_json_atomic

        write_json_atomic(os.path.join(self.control, "pull-state.json"), self.state)

    def header_path(self, shard: str) -> str:
        """A sparse file of the shard's full size holding only its header: parsed like the shard itself."""
        p = os.path.join(self.control, "headers", shard)
        size = self.remote.files[shard].size
        if not (os.path.isfile(p) and os.path.getsize(p) == size):
            head = self.remote.header(shard)
            tmp = p + f".tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(head)
                f.truncate(size)
            os.replace(tmp, p)
        return p

    def path(self, shard: str) -> str:
        return os.path.join(self.src, shard)

    def landed(self, shard: str) -> bool:
        return shard in self.state["landed"] and os.path.isfile(self.path(shard))

    def resident(self) -> list[str]:
        return [s for s in self.shards if self.landed(s)]

    # -- the packer's side --------------------------------------------------------------------------
    def wait(self, shard: str) -> str:
        with self.cond:
            while not self.landed(shard):
                if self.error is not None:
                    raise self.error
                self.demand.add(shard)
                self.cond.notify_all()
                self.cond.wait(0.5)
            return self.path(shard)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="deltafin-pull", daemon=True)
        self.thread.start()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join()

    # -- the downloader -----------------------------------------------------------------------------
    def _next(self) -> tuple[str | None, bool]:
        """(shard to fetch, demanded) or (None, False) when nothing is to be fetched now."""
        for s in self.shards:
            if s in self.demand and not self.landed(s):
                return s, True
        for s in self.shards:
            if not self.landed(s) and s not in self.state["removed"]:
                return s, False
        return None, False

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    if self.closed:
                        return
                    shard, demanded = self._next()
                    full = self.opts.delete_source and len(self.resident()) >= self.opts.window
                    if shard is None or (full and not demanded):
                        self.cond.wait(0.2)
                        wait = True
                    else:
                        wait = False
                if wait:
                    self.collect()
                    continue
                self.fetch(shard)
                self.collect()
        except BaseException as e:  # handed to the packer, which is waiting on a shard
            with self.cond:
                self.error = e if isinstance(e, DeltafinError) else CheckpointError(f"download failed: {e}")
                self.cond.notify_all()

    def fetch(self, shard: str) -> None:
        want = self.remote.sha256(shard)
        for attempt in (1, 2):
            path = self.remote.download(shard)
            got = _file_sha256(path) if want else None
            if got == want:
                break
            os.unlink(path)
            log.warning("%s: sha256 %s does not match the Hub's %s (damaged in transit); downloading it again",
                        shard, got[:12], want[:12])
            if attempt == 2:
                raise CheckpointError(f"{self.remote.repo_id}/{shard}: downloaded twice and both copies fail their "
                                      f"sha256 (expected {want[:16]}..., got {got[:16]}...); the server or the network "
                                      f"damages it: re-run 'deltafin pull' later to resume")
        with self.cond:
            self.state["landed"][shard] = want or "unchecked"
            if shard in self.state["removed"]:
                self.state["removed"].remove(shard)
            self.save()
            self.downloaded.append(shard)
            self.demand.discard(shard)
            self.peak = max(self.peak, sum(self.remote.files[s].size for s in self.resident()))
            self.cond.notify_all()

    def collect(self) -> int:
        """Remove the landed shards whose packed files are all durable and read back (delete_source)."""
        if not self.opts.delete_source or self.done_check is None:
            return 0
        with self.collecting:  # the downloader and the final pass after the pack
            return self._collect()

    def _collect(self) -> int:
        n = 0
        for s in self.resident():
            if s in self.demand or not self.done_check(s):
                continue
            with self.cond:
                os.unlink(self.path(s))
                meta = os.path.join(self.src, ".cache", "huggingface", "download", s + ".metadata")
                with contextlib.suppress(OSError):
                    os.unlink(meta)
                del self.state["landed"][s]
                self.state["removed"].append(s)
                self.save()
                self.cond.notify_all()
            log.info("%s: packed and read back; removed", s)
            n += 1
        return n


# ---------------------------------------------------------------- the packer's order and read-back


def pack_steps(plan) -> list[tuple[str, object, set[str]]]:
    """The packer's steps in order, (kind, layer, checkpoint tensor names): each layer's trunk file, then its
    experts; the top-level trunk file last (as ``pack`` writes them)."""
    trunk: dict = {}
    for t in plan.trunk:
        trunk.setdefault(t.layer, set()).update(n for n in (t.source, t.scale_inv) if n)
    experts: dict[int, set[str]] = {}
    for (L, _e), roles in plan.expert_names.items():
        experts.setdefault(L, set()).update(n for kinds in roles.values() for n in kinds.values())
    steps = []
    for L in sorted({k for k in trunk if k is not None} | set(plan.moe_layers)):
        if L in trunk:
            steps.append(("trunk", L, trunk[L]))
        if L in plan.moe_layers:
            steps.append(("experts", L, experts.get(L, set())))
    if None in trunk:
        steps.append(("trunk", None, trunk[None]))
    return steps


def shard_order(ckpt: Checkpoint, steps) -> tuple[list[str], dict[str, list[int]]]:
    """Shards by the first step that reads them (unread shards last), and the steps that read each."""
    uses: dict[str, list[int]] = {}
    for i, (_k, _L, names) in enumerate(steps):
        for n in names:
            sh = ckpt.weight_map.get(n)
            if sh is not None and i not in uses.setdefault(sh, []):
                uses[sh].append(i)
    order = sorted(uses, key=lambda s: (min(uses[s]), s))
    return order + [s for s in ckpt.shards() if s not in uses], uses


class ReadBack:
    """Whether the pack steps that read a shard have their files durable (in the packer's record) and read
    back against their checksums; a step found good is not read again."""

    def __init__(self, out: str, drives: list[str], model_id: str, steps, uses: dict[str, list[int]],
                 file_bytes: dict[int, int]):
        self.out, self.drives, self.model_id, self.steps, self.uses = out, drives, model_id, steps, uses
        self.file_bytes = file_bytes
        self.verified: set[int] = set()

    def _progress(self) -> dict | None:
        """The packer's record: pack-state.json while it runs, the manifest once it has finished."""
        from deltafin.store import manifest as mf
        from deltafin.store.pack_state import STATE, state_from_manifest

        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(self.out, STATE)) as f:
                return json.load(f)
        with contextlib.suppress(DeltafinError, OSError, ValueError, KeyError):
            doc = mf.load(self.out)
            return state_from_manifest(doc, doc.get("fingerprint"))
        return None

    def _expert_ok(self, layout, L: int, e: int, digest: str) -> bool:
        from deltafin.store import expert_file as ef
        from deltafin.store import manifest as mf
        from deltafin.store.place import relpath

        keys = sorted(layout.files(L, e, self.file_bytes[L]))
        files = [_read(mf.resolve_under(self.drives[k[0]], relpath(self.model_id, L, e, k))) for k in keys]
        if L in layout.stripe:  # a striped expert's checksum covers its pieces together
            return bool(files) and ef.checksum(b"".join(files)) == digest
        return bool(files) and all(ef.checksum(f) == digest for f in files)

    def step_done(self, i: int, state: dict) -> bool:
        from deltafin.store.place import Layout
        from deltafin.store.trunk import trunk_intact

        if i in self.verified:
            return True
        kind, L, _ = self.steps[i]
        if kind == "trunk":
            rel = os.path.join("trunk", f"layer-{L:03d}.safetensors" if L is not None else "global.safetensors")
            ok = rel in state.get("trunk", []) and trunk_intact(os.path.join(self.out, rel),
                                                                 (state.get("trunk_files") or {}).get(rel))
        else:
            done = (state.get("experts") or {}).get(str(L), {})
            locs = (state.get("locations") or {}).get(str(L))
            ok = locs is not None and len(done) == len(locs)
            if ok:
                layout = Layout(state.get("placement", "bandwidth"), {L: locs},
                                {int(k): v for k, v in (state.get("stripe") or {}).items()})
                ok = all(self._expert_ok(layout, L, e, done[str(e)]) for e in range(len(locs)))
        if ok:
            self.verified.add(i)
        return ok

    def __call__(self, shard: str) -> bool:
        state = self._progress()
        return state is not None and all(self.step_done(i, state) for i in self.uses.get(shard, []))


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


# ---------------------------------------------------------------- the whole pull


def _side_files(remote: Remote) -> list[str]:
    from deltafin.store.pack import TOKENIZER_FILES, TOKENIZER_PATTERNS

    return [n for n in remote.files if "/" not in n and (n in SIDE_FILES or n in TOKENIZER_FILES
                                                        or any(p.fullmatch(n) for p in TOKENIZER_PATTERNS))]


def _shards(remote: Remote, src: str) -> list[str]:
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set((json.load(f).get("weight_map") or {}).values()))
    else:
        names = ["model.safetensors"]
    missing = [n for n in names if n not in remote.files]
    if missing:
        raise CheckpointError(f"{remote.repo_id}: {', '.join(missing[:3])} named in the index but not in the repo; "
                              f"the repo is incomplete: choose another revision")
    return names


def prepare(repo_id: str, src: str, opts: PullOptions) -> tuple[Remote, ShardFeed, StreamedCheckpoint]:
    """The small files and every shard's header in ``src``: enough to plan the pack, no weights."""
    os.makedirs(src, exist_ok=True)
    remote = Remote(repo_id, opts, src)
    if "config.json" not in remote.files:
        raise UsageError(f"{repo_id}: the repo has no config.json; it is not a Hugging Face model checkpoint")
    if not any(n.endswith(".safetensors") for n in remote.files):
        raise UsageError(f"{repo_id}: the repo has no safetensors files (only {', '.join(list(remote.files)[:4])}); "
                         f"Deltafin packs safetensors checkpoints: look for a safetensors revision of the model")
    for name in _side_files(remote):
        remote.download(name)
    feed = ShardFeed(remote, _shards(remote, src), opts)
    for s in feed.shards:
        feed.header_path(s)
    return remote, feed, StreamedCheckpoint(src, feed)


def plan_pull(repo_id: str, src: str, pack_opts, opts: PullOptions, drives) -> dict:
    """What a pull downloads and the disk it needs at its peak, with and without ``delete_source``."""
    from deltafin.store.plan import build_plan

    remote, feed, ckpt = prepare(repo_id, src, opts)
    plan = build_plan(ckpt, pack_opts.experts, pack_opts.trunk)
    steps = pack_steps(plan)
    order, uses = shard_order(ckpt, steps)
    sizes = {s: remote.files[s].size for s in order}
    by_step = [sum(sizes[s] for s in sizes if i in uses.get(s, [])) for i in range(len(steps))]
    ahead = sum(sorted(sizes.values())[-max(opts.window, 1):])
    window_peak = max(ahead, max(by_step, default=0) + max(sizes.values(), default=0))
    pack_bytes = plan.expert_bytes + plan.trunk_bytes
    return {"repo": repo_id, "commit": remote.commit, "shards": len(order), "source_bytes": sum(sizes.values()),
            "largest_shard_bytes": max(sizes.values(), default=0), "pack_bytes": pack_bytes,
            "expert_bytes": plan.expert_bytes, "trunk_bytes": plan.trunk_bytes, "window": opts.window,
            "peak_bytes_delete_source": pack_bytes + window_peak,
            "peak_bytes_keep_source": pack_bytes + sum(sizes.values()), "order": order,
            "drives": [d.path for d in drives]}


def pull(repo_id: str, out: str, drive_args, pack_opts, opts: PullOptions = PullOptions()) -> PullSummary:
    """Download ``repo_id`` and pack it into ``out`` over ``drive_args`` as the shards land."""
    from deltafin.store import manifest as mf
    from deltafin.store.pack import _default_id, pack
    from deltafin.store.plan import build_plan

    t0 = time.perf_counter()
    if opts.window < 1:
        raise UsageError(f"--window {opts.window}: shards fetched ahead must be 1 or more")
    out = os.path.abspath(out)
    src = os.path.abspath(opts.source_dir or os.path.join(out, "source"))
    remote, feed, ckpt = prepare(repo_id, src, opts)
    plan = build_plan(ckpt, pack_opts.experts, pack_opts.trunk)
    steps = pack_steps(plan)
    feed.shards, uses = shard_order(ckpt, steps)
    prior_id = None
    with contextlib.suppress(DeltafinError, OSError, ValueError, KeyError):
        prior_id = mf.load(out)["model_id"]
    model_id = pack_opts.model_id or prior_id or _default_id(out)
    paths = [os.path.abspath(d.path) for d in drive_args] or [os.path.join(out, "experts")]
    feed.done_check = ReadBack(out, paths, model_id, steps, uses,
                               {L: plan.layouts[L].file_bytes for L in plan.moe_layers})
    feed.start()
    try:
        summary = pack(ckpt, out, drive_args, pack_opts)
        feed.collect()  # the last shards, now that the manifest is written
    finally:
        feed.close()
    kept = [s for s in feed.shards if feed.landed(s)]
    if opts.delete_source and kept:
        raise CheckpointError(f"{out}: packed, but {len(kept)} shard(s) ({kept[0]}, ...) did not read back against "
                              f"their packed files and were kept; run 'deltafin verify {out}'")
    return PullSummary(repo_id, remote.commit, len(feed.shards), len(feed.downloaded), len(feed.state["removed"]),
                       sum(remote.files[s].size for s in feed.shards), feed.peak, summary,
                       time.perf_counter() - t0, list(feed.downloaded))
