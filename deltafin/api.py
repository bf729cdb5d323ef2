"""The Python API: ``deltafin.load`` a packed model, then ``generate``, ``stream``, ``chat`` and ``classify``.

Defaults are the command line's: the fused-kernel fast path (``exact=True`` for the float32 reference),
a text prompt as one user turn of the checkpoint's chat template (``raw=True`` for plain text), and the
sampler of ``deltafin run`` (temperature 0.7, top-p 0.95; ``temperature=0`` is greedy).

    import deltafin
    m = deltafin.load("k3")                       # a packed model folder or its id in 'deltafin list'
    out = m.generate("Summarise the quarter", max_tokens=200, temperature=0)
    print(out.text, out.stats.decode_tok_s)
    for piece in m.stream("Write a haiku"): print(piece, end="")
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from deltafin.errors import UsageError
from deltafin.runtime.stats import RunStats


@dataclass
class Generation:
    """One reply: its text (reasoning apart), the token ids, why it stopped, and the run's statistics."""

    text: str
    tokens: list[int]
    finish_reason: str
    stats: RunStats
    reasoning: str = ""

    def __str__(self) -> str:
        return self.text


@dataclass
class Sampling:
    """The sampler's settings, as ``deltafin run`` takes them (``temperature=0``: greedy)."""

    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = field(default_factory=tuple)

    def params(self):
        from deltafin.runtime.sampling import SamplingParams

        return SamplingParams(self.temperature, self.top_p, self.top_k, self.seed, self.min_p,
                              self.presence_penalty, self.frequency_penalty, self.repetition_penalty)


def _sampling(max_tokens: int, kw: dict) -> Sampling:
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise UsageError(f"max_tokens={max_tokens!r}: give a whole number of tokens >= 1, e.g. max_tokens=128")
    unknown = set(kw) - set(Sampling.__dataclass_fields__)
    if unknown:
        raise UsageError(f"unknown sampling argument(s) {', '.join(sorted(unknown))}; known: "
                         f"{', '.join(Sampling.__dataclass_fields__)}")
    stop = kw.pop("stop", ())
    return Sampling(**kw, stop=(stop,) if isinstance(stop, str) else tuple(stop))


class Model:
    """A packed model open for generation; ``close()`` (or a ``with`` block) releases its reader threads."""

    def __init__(self, engine):
        self.engine = engine
        self.last: Generation | None = None

    # -- prompts ------------------------------------------------------------------------------------
    def _ids(self, prompt, system: str | None, raw: bool, thinking: bool | None) -> tuple[list[int], bool]:
        """Token ids of a prompt (text, messages or ids) and whether they are a chat prompt."""
        codec = self.engine.codec
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            if not prompt:
                raise UsageError("the prompt is an empty list of token ids; give at least one id")
            vocab = int(self.engine.packed.text_config["vocab_size"])
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise UsageError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
            return list(prompt), False
        if codec is None:
            raise UsageError(f"{self.engine.packed.path} has no tokenizer files; give the prompt as token ids")
        if isinstance(prompt, list):  # messages
            return codec.chat(_check_messages(prompt), thinking=thinking), True
        if not isinstance(prompt, str):
            raise UsageError(f"prompt of type {type(prompt).__name__}: give text, a list of messages or token ids")
        if raw or not codec.has_chat_template:
            if system:
                raise UsageError("system= needs the chat template; drop raw=True (or the system prompt)")
            return codec.prompt_ids(prompt), False
        messages = [{"role": "system", "content": system}] if system else []
        return codec.chat(messages + [{"role": "user", "content": prompt}], thinking=thinking), True

    # -- generation ---------------------------------------------------------------------------------
    def stream(self, prompt, max_tokens: int = 128, *, system: str | None = None, raw: bool = False,
               thinking: bool | None = None, **sampling) -> Iterator[str]:
        """Yield the reply's text as it is generated (reasoning is kept apart, in ``self.last.reasoning``);
        when the iterator ends, ``self.last`` holds the whole ``Generation``."""
        from deltafin.runtime.reasoning import Parts, splitter_for

        s = _sampling(max_tokens, sampling)
        ids, chat = self._ids(prompt, system, raw, thinking)
        eng = self.engine
        split, parts = splitter_for(eng.codec, ids, chat), Parts()
        for _tok, delta in eng.generate(ids, max_tokens, s.params(), stop_strings=s.stop):
            got = split.feed(delta)
            parts += got
            if got.content:
                yield got.content
        tail = split.flush()
        parts += tail
        if tail.content:
            yield tail.content
        st = eng.last_stats
        self.last = Generation(parts.content, list(st.tokens), st.stop_reason, st, parts.reasoning)

    def generate(self, prompt, max_tokens: int = 128, **kw) -> Generation:
        """The whole reply to ``prompt`` (text: one user turn of the chat template; a list of messages;
        or token ids) with its statistics."""
        for _ in self.stream(prompt, max_tokens, **kw):
            pass
        assert self.last is not None
        return self.last

    def chat(self, messages: list[dict], max_tokens: int = 128, **kw) -> Generation:
        """The assistant's reply to a conversation of ``{"role", "content"}`` messages."""
        return self.generate(_check_messages(messages), max_tokens, **kw)

    def classify(self, texts: list[str] | str, labels: list[str], template: str = "{input}", chat: bool = False,
                 label_prefix: str = "", batch_size: int = 8) -> list[dict]:
        """Per text: ``{"label", "probs"}`` (normalised over the labels) and ``raw_probs`` (under the whole
        vocabulary), each label scored as the model's next tokens after the text put into ``template``."""
        from deltafin.jobs.classify import Classifier, Item

        texts = [texts] if isinstance(texts, str) else list(texts)
        if batch_size < 1:
            raise UsageError(f"batch_size={batch_size}: give 1 or more")
        clf = Classifier(self.engine, list(labels), template, chat, label_prefix)
        out: list[dict] = []
        for first in range(0, len(texts), batch_size):
            group = texts[first : first + batch_size]
            prompts = [clf.prompt(t) for t in group]
            for t, ids in zip(group, prompts, strict=True):
                why = clf.check(ids)
                if why:
                    raise UsageError(f"input {texts.index(t)}: {why}")
            for i, logps in enumerate(clf.score(prompts)):
                rec = clf.result(Item(str(first + i), first + i, group[i]), logps)
                out.append({k: rec[k] for k in ("label", "probs", "raw_probs")})
        return out

    @property
    def stats(self) -> RunStats | None:
        return self.last.stats if self.last else None

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise UsageError("messages: give a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool") \
                or not isinstance(m.get("content"), str):
            raise UsageError(f"messages[{i}]: expected {{'role': 'system'|'user'|'assistant', 'content': str}}, "
                             f"got {m!r:.80}")
    return messages


def load(model: str, *, device: str = "auto", cache_gb: float | None = None, max_len: int | None = None,
         exact: bool = False, dtype: str = "auto", io_threads: int = 4, drive_map: dict[str, str] | None = None,
         chat_template: str | None = None, verify_reads: bool = True, progress: bool = False,
         gpu_layers: int | None = None, gpu_memory_gb: float | None = None) -> Model:
    """Open a packed model (a folder, or its id as ``deltafin list`` shows it) as ``deltafin run`` does.
    ``gpu_layers``/``gpu_memory_gb``: partial GPU offload on CUDA (``--gpu-layers``/``--gpu-memory-gb``)."""
    from deltafin.interfaces.checks import check_engine_numbers
    from deltafin.interfaces.paths import resolve_packed
    from deltafin.runtime.engine import Engine, EngineOptions
    from deltafin.runtime.offload_plan import check_offload_args

    check_engine_numbers(cache_gb=cache_gb, io_threads=io_threads, max_len=max_len, style="python")
    check_offload_args(gpu_layers, gpu_memory_gb, device)
    path = resolve_packed(model)
    eng = Engine(path, EngineOptions(device=device, cache_gb=cache_gb, threads=io_threads, max_len=max_len,
                                     exact=exact, dtype=dtype, drive_map=drive_map, verify_reads=verify_reads,
                                     progress=progress, gpu_layers=gpu_layers, gpu_memory_gb=gpu_memory_gb))
    if chat_template is not None:
        if eng.codec is None:
            eng.close()
            raise UsageError(f"chat_template: {path} has no tokenizer files to use it with")
        eng.codec.use_template(chat_template, "chat_template")
    return Model(eng)
