"""Routing traces: which experts each token was routed to, per MoE layer, as JSONL.

``deltafin run --record-routes PATH`` writes one; the ``coactivation`` and ``replicas`` placements
(``deltafin place --trace PATH``, ``deltafin pack --trace PATH``) read it. Format::

    {"format": "deltafin-routes", "version": 1, "model_id": "k3", "num_experts": 896, "moe_layers": [1, 2, ...]}
    {"token": 0, "routes": {"1": [4, 17, ...], "2": [...], ...}}
    {"token": 1, "routes": {...}}

The first line is a header; every further line is one token: for each MoE layer (a string key, as
JSON needs), the ids of the experts the router picked, sorted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from deltafin.errors import UsageError

FORMAT = "deltafin-routes"
VERSION = 1


class RouteWriter:
    """Appends one token's routes per ``write`` call; the file is flushed after every token."""

    def __init__(self, path: str, model_id: str, num_experts: int, moe_layers: Sequence[int]):
        self.path = os.path.abspath(path)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._f = open(self.path, "w")  # noqa: SIM115 - open for the writer's lifetime
        self.tokens = 0
        self._layers = list(moe_layers)
        head = {"format": FORMAT, "version": VERSION, "model_id": model_id, "num_experts": num_experts,
                "moe_layers": self._layers}
        self._f.write(json.dumps(head) + "\n")
        self._f.flush()

    def write(self, fetches: Sequence[tuple[int, Sequence[int]]]) -> None:
        """One token: the (layer, expert ids) pairs its forward pass fetched."""
        routes = {str(layer): sorted(int(e) for e in ids) for layer, ids in fetches}
        self._f.write(json.dumps({"token": self.tokens, "routes": routes}, separators=(",", ":")) + "\n")
        self._f.flush()
        self.tokens += 1

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def read_routes(path: str, num_experts: int | None = None) -> list[dict[int, list[int]]]:
    """A routing trace as placement takes it: one dict (layer -> expert ids) per token.

    Raises ``UsageError`` naming the file and line of anything malformed, or of expert ids out of
    range for a model with ``num_experts`` experts per layer.
    """
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise UsageError(f"routing trace {path}: cannot read it ({e.strerror}); record one with "
                         f"'deltafin run MODEL --record-routes {path}'") from e
    out: list[dict[int, list[int]]] = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError as e:
            raise UsageError(f"routing trace {path}, line {i}: not JSON ({e})") from e
        if isinstance(doc, dict) and doc.get("format") == FORMAT:
            if doc.get("version") != VERSION:
                raise UsageError(f"routing trace {path}: version {doc.get('version')!r} is not {VERSION}; "
                                 f"record it again with this Deltafin")
            num_experts = num_experts or doc.get("num_experts")
            continue
        out.append(_token(doc, path, i, num_experts))
    if not out:
        raise UsageError(f"routing trace {path} holds no tokens; record one with 'deltafin run MODEL -n 64 "
                         f"--record-routes {path}'")
    return out


def _token(doc, path: str, line: int, num_experts: int | None) -> dict[int, list[int]]:
    routes = doc.get("routes") if isinstance(doc, dict) else None
    if not isinstance(routes, dict):
        raise UsageError(f"routing trace {path}, line {line}: expected {{\"token\": N, \"routes\": "
                         f"{{\"LAYER\": [ids...]}}}}, got {str(doc)[:80]}")
    tok = {}
    for layer, ids in routes.items():
        if not (layer.isdigit() and isinstance(ids, list) and all(isinstance(e, int) for e in ids)):
            raise UsageError(f"routing trace {path}, line {line}: layer {layer!r} needs a list of integer "
                             f"expert ids, got {ids!r}")
        bad = [e for e in ids if e < 0 or (num_experts is not None and e >= num_experts)]
        if bad:
            raise UsageError(f"routing trace {path}, line {line}: expert id {bad[0]} in layer {layer} is out of "
                             f"range for {num_experts} experts; record the trace with this model")
        tok[int(layer)] = ids
    return tok
