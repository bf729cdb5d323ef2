"""Thinking options of a chat request: ``reasoning_effort`` (OpenAI) and ``chat_template_kwargs`` (vLLM).

``reasoning_effort``: "none" turns thinking off; "minimal" is taken as "low"; "low", "medium", "high" (and
Kimi K3's "max") set the effort. ``chat_template_kwargs``: variables for the chat template, e.g.
``{"enable_thinking": false}`` (Qwen3) or ``{"thinking": false}`` (Kimi K3). The server's ``--think``,
``--no-think`` and ``--effort`` give the defaults a request may override.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from deltafin.serve.protocol import APIError

EFFORTS = ("none", "minimal", "low", "medium", "high", "max")


@dataclass(frozen=True)
class ThinkingOptions:
    thinking: bool | None = None  # None: the template's default (Kimi K3: on)
    effort: str | None = None
    template_kwargs: dict = field(default_factory=dict)

    def chat_kwargs(self) -> dict:
        return {"thinking": self.thinking, "effort": self.effort, "template_kwargs": self.template_kwargs}


def take_thinking(body: object, defaults: ThinkingOptions, kimi: bool) -> ThinkingOptions:
    """Remove the thinking fields from a chat request body and return the options they give."""
    if not isinstance(body, dict):
        return defaults
    opts = defaults
    kw = body.pop("chat_template_kwargs", None)
    if kw is not None:
        if not isinstance(kw, dict) or not all(isinstance(k, str) for k in kw):
            raise APIError(400, f"chat_template_kwargs must be an object of template variables, got {kw!r:.100}",
                           param="chat_template_kwargs")
        think = kw.get("thinking", kw.get("enable_thinking"))
        if think is not None and not isinstance(think, bool):
            raise APIError(400, f"chat_template_kwargs thinking must be true or false, got {think!r:.50}",
                           param="chat_template_kwargs")
        opts = replace(opts, template_kwargs={**opts.template_kwargs, **kw},
                       thinking=opts.thinking if think is None else think)
    effort = body.pop("reasoning_effort", None)
    if effort is not None:
        allowed = EFFORTS if kimi else EFFORTS[:-1]
        if effort not in allowed:
            raise APIError(400, f"reasoning_effort must be one of {', '.join(allowed)}, got {effort!r:.50}",
                           param="reasoning_effort")
        if effort == "none":
            opts = replace(opts, thinking=False, effort=None)
        else:
            opts = replace(opts, thinking=True if opts.thinking is None else opts.thinking,
                           effort="low" if effort == "minimal" else effort)
    return opts
