"""``deltafin chat``: an interactive session over one engine whose model state is kept between turns.

Line editing and history through readline (history in the Deltafin home), slash commands, Ctrl-C stops
the reply without ending the session, and a full context is reported instead of ending it.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys

from deltafin.errors import UsageError

HELP = """commands:
  /help            this list
  /clear           forget the conversation (the system prompt stays)
  /system [TEXT]   show or set the system prompt (setting it starts the conversation over)
  /save FILE       write the conversation to FILE (JSON: system prompt and messages)
  /load FILE       replace the conversation with FILE's and read it into the model
  /stats           statistics of the last reply and how much of the context is used
  /exit, /quit     leave (Ctrl-D too)
Ctrl-C stops a reply and keeps the session."""


LOAD_MAX_BYTES = 64 << 20  # a saved conversation; far past any context's text

class ChatSession:
    """The conversation, the model state that has read it, and the commands that change both."""

    def __init__(self, eng, args, out=None):
        from deltafin.interfaces.prompt import stop_strings
        from deltafin.interfaces.session import chat_kwargs, sampling_params

        self.eng, self.args = eng, args
        self.opts = chat_kwargs(eng, args)  # --think/--no-think, --effort
        self.out = out or sys.stdout
        self.sampling, self.stops = sampling_params(args), stop_strings(args)
        self.system: str | None = args.system
        self.stop_requested = False
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.state = self.eng.new_state()
        self.pending: int | None = None  # a stop token that ended the last reply but was not fed yet
        self.stale = False  # a reply was stopped: the messages end in a reply without its end-of-turn marker
        self.fed: list[int] = []  # the tokens the model state has read, in order

    @property
    def max_len(self) -> int:
        return self.eng.opts.max_len

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    # -- commands -----------------------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a /command; False when the session should end."""
        name, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        if name in ("/exit", "/quit"):
            return False
        handler = {"/help": lambda: self.say(HELP), "/clear": self._clear, "/system": lambda: self._system(rest),
                   "/save": lambda: self._save(rest), "/load": lambda: self._load(rest),
                   "/stats": self._stats}.get(name)
        if handler is None:
            self.say(f"unknown command {name}; /help lists the commands")
        else:
            try:
                handler()
            except (OSError, ValueError, UsageError) as e:
                self.say(f"{name}: {e}")
        return True

    def _clear(self) -> None:
        self.reset()
        self.say("conversation cleared" + (" (system prompt kept)" if self.system else ""))

    def _system(self, text: str) -> None:
        if not text:
            self.say(f"system prompt: {self.system!r}" if self.system else "no system prompt")
            return
        self.system = text
        self.reset()
        self.say("system prompt set; the conversation starts over")

    def _save(self, path: str) -> None:
        if not path:
            raise ValueError("give a file: /save FILE")
        from deltafin.store.manifest import write_json_atomic

        write_json_atomic(path, {"format": "deltafin-chat", "version": 1, "system": self.system,
                                 "messages": [m for m in self.messages if m["role"] != "system"]})
        self.say(f"saved {sum(m['role'] != 'system' for m in self.messages)} messages to {path}")

    def _load(self, path: str) -> None:
        if not path:
            raise ValueError("give a file: /load FILE")
        from deltafin.jobs.files import read_regular

        try:  # a regular file of bounded size: /dev/zero or a FIFO would never end
            doc = json.loads(read_regular(path, LOAD_MAX_BYTES, "conversation file"))
        except RecursionError:
            raise ValueError(f"{path}: nested too deeply to be a conversation written by /save") from None
        msgs = doc.get("messages") if isinstance(doc, dict) else None
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and m.get("role") in ("user", "assistant")
                                                 and isinstance(m.get("content"), str) for m in msgs):
            raise ValueError(f"{path} is not a conversation written by /save (messages of user/assistant text)")
        self.system = doc.get("system") or None
        self.reset()
        self.messages += msgs
        if msgs:
            ids = self.eng.codec.chat(self.messages, add_generation_prompt=False, **self.opts)
            if len(ids) >= self.max_len:
                self.reset()
                raise ValueError(f"the conversation is {len(ids):,} tokens, over the context of {self.max_len:,}; "
                                 f"restart with a larger -c")
            self.eng.prefill([ids], [self.state])
            self.fed = list(ids)
        self.say(f"loaded {len(msgs)} messages from {path} ({self.state.pos:,} tokens read)")

    def _stats(self) -> None:
        st = getattr(self.eng, "last_stats", None)
        self.say(f"context: {self.state.pos:,} of {self.max_len:,} tokens used; {len(self.messages)} messages")
        if st is not None and st.tokens:
            from deltafin.interfaces.session import verbose

            self.say(st.summary(verbose(self.args)))

    # -- a turn -------------------------------------------------------------------------------------
    def turn(self, user: str) -> bool:
        """Reply to one user message, streaming the text; stops at Ctrl-C or at the end of the context.
        True when a reply ran to its end (its statistics are in ``eng.last_stats``)."""
        from deltafin.interfaces.session import Printer, turn_tokens

        eng = self.eng
        was_stale = self.stale
        if self.stale:  # after a stopped reply: what the rendered conversation adds to what the state read
            self.messages.append({"role": "user", "content": user})
            new = extension(self.fed, eng.codec.chat(self.messages, **self.opts))
            self.stale = False
        else:
            new = turn_tokens(eng, self.messages, user, self.pending, self.opts)
        replay = new is None  # the state's tokens are not a prefix of the rendered conversation: re-read it all
        if replay:
            self.state, self.fed, new = eng.new_state(), [], eng.codec.chat(self.messages, **self.opts)
        room = self.max_len - self.state.pos - len(new)
        if room < 1:
            self.messages.pop()
            self.stale = was_stale or replay
            self.say(f"[context full: {self.state.pos:,} of {self.max_len:,} tokens used and this turn needs "
                     f"{len(new):,} more; /clear starts over, /save keeps the conversation, or restart with a "
                     f"larger -c]")
            return False
        self.stop_requested = False
        self.out.write("assistant> ")
        text, got, stopped = "", [], False
        shown = Printer(eng, new, True, getattr(self.args, "quiet", False), self.out)
        with _interrupts(self):
            for tok, delta in eng.generate(new, min(self.args.max_tokens, room), self.sampling, state=self.state,
                                           stop_strings=self.stops):
                got.append(tok)
                text += delta
                shown.write(delta)
                if self.stop_requested:
                    stopped = True
                    break
        shown.write("", last=True)
        self.fed = (self.fed + new + got)[: self.state.pos]  # the prompt, then each reply token fed back
        self.out.write("\n")
        if stopped:
            # The generator was closed between tokens, so the state is whole, but the stopped reply has no
            # end-of-turn marker in it: the next turn feeds what the rendered conversation adds to it.
            self.messages.append({"role": "assistant", "content": shown.parts.content,
                                  "reasoning_content": shown.parts.reasoning})
            self.pending, self.stale = None, True
            self.say("[reply stopped; the conversation is kept]")
            return False
        st = eng.last_stats
        self.pending = st.tokens[-1] if st.tokens and st.stop_reason == "stop token" else None
        self.messages.append({"role": "assistant", "content": shown.parts.content,
                              "reasoning_content": shown.parts.reasoning})
        if self.state.pos + 1 >= self.max_len:
            self.say(f"[context full ({self.max_len:,} tokens): /clear to start over]")
        return True


def extension(fed: list[int], full: list[int]) -> list[int] | None:
    """The tokens ``full`` adds after ``fed``, or None when ``fed`` is not a prefix of it (a template that
    rewrites earlier turns, or reply tokens that encode differently as text)."""
    return full[len(fed):] if len(full) > len(fed) and full[: len(fed)] == fed else None


@contextlib.contextmanager
def _interrupts(session: ChatSession):
    """Ctrl-C while a reply streams asks it to stop after the current token (the model state stays whole);
    a second Ctrl-C interrupts at once."""
    def handler(signum, frame):
        if session.stop_requested:
            raise KeyboardInterrupt
        session.stop_requested = True

    try:
        old = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: leave Ctrl-C alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _history():
    """readline with a history file in the Deltafin home, when stdin is a terminal and readline exists."""
    try:
        import readline
    except ImportError:
        return None
    from deltafin import home

    path = home.path("chat_history")
    with contextlib.suppress(OSError):
        readline.read_history_file(path)
    readline.set_history_length(2000)
    return lambda: readline.write_history_file(path)


def run_chat(eng, args) -> int:
    if eng.codec is None:
        raise UsageError(f"{eng.packed.path} has no tokenizer files, so chat is not possible")
    session = ChatSession(eng, args)
    tty = sys.stdin.isatty()
    save = _history() if tty else None
    if tty and not args.quiet:
        session.say("/help for commands, Ctrl-C stops a reply, Ctrl-D or /exit leaves")
    try:
        while True:
            try:
                line = input("you> ") if tty else sys.stdin.readline()
            except EOFError:
                break
            except KeyboardInterrupt:  # at the prompt: a new line, as shells do
                session.say("\n(Ctrl-D or /exit leaves)")
                continue
            if not line:
                break
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.startswith("/"):
                if not session.command(line):
                    break
                continue
            if session.turn(line):
                from deltafin.interfaces.session import report

                report(eng, args, one_line=True)
    finally:
        if save is not None:
            with contextlib.suppress(OSError):
                save()
    return 0
