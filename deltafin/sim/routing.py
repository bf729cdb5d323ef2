"""Which experts each token routes to, per layer: uniform, Zipf-skewed, or replayed from a trace."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from deltafin.sim.model import MoEShape


class UniformRouter:
    """Every token picks ``top_k`` distinct experts uniformly (Kimi K3's router is trained flat)."""

    def __init__(self, shape: MoEShape, seed: int = 0):
        import numpy as np

        self.shape = shape
        self._rng = np.random.default_rng(seed)

    def route(self, token: int, layer: int) -> list[int]:
        return self.route_batch(1, layer)[0]

    def route_batch(self, tokens: int, layer: int) -> list[list[int]]:
        """Routes of ``tokens`` tokens through one layer (prefill)."""
        import numpy as np

        keys = self._rng.random((tokens, self.shape.experts))
        return np.argpartition(keys, self.shape.top_k - 1, axis=1)[:, : self.shape.top_k].tolist()


class ZipfRouter:
    """Experts drawn without replacement with weight 1 / rank**skew; each layer ranks its experts
    in its own random order, so hot experts differ between layers."""

    def __init__(self, shape: MoEShape, skew: float, seed: int = 0, structure_seed: int = 0):
        import numpy as np

        if skew < 0:
            raise ValueError(f"Zipf skew must be >= 0, got {skew}")
        self.shape = shape
        self._rng = np.random.default_rng(seed)
        w = 1.0 / np.arange(1, shape.experts + 1) ** skew
        self._p = w / w.sum()
        perm = np.random.default_rng(structure_seed + 1)
        self._rank_to_expert = [perm.permutation(shape.experts) for _ in range(shape.layers)]

    def route(self, token: int, layer: int) -> list[int]:
        ranks = self._rng.choice(self.shape.experts, self.shape.top_k, replace=False, p=self._p)
        return [int(self._rank_to_expert[layer][r]) for r in ranks]

    def route_batch(self, tokens: int, layer: int) -> list[list[int]]:
        return [self.route(t, layer) for t in range(tokens)]


class ClusteredRouter:
    """Experts come in fixed groups per layer that tokens tend to route to together: with
    probability ``affinity`` a token's next pick is a whole group, else one uniform expert. A stand-in
    for the co-activation structure of real routers."""

    def __init__(self, shape: MoEShape, group: int, affinity: float, seed: int = 0, structure_seed: int = 0):
        import random

        if group < 2 or not 0 <= affinity <= 1:
            raise ValueError(f"clustered routing needs group >= 2 and affinity in [0, 1], got {group}, {affinity}")
        self.shape = shape
        self.affinity = affinity
        self._rng = random.Random(seed)
        perm = random.Random(structure_seed + 1)
        self._groups = []
        for _ in range(shape.layers):
            order = perm.sample(range(shape.experts), shape.experts)
            self._groups.append([order[i : i + group] for i in range(0, shape.experts, group)])

    def route(self, token: int, layer: int) -> list[int]:
        k, rng = self.shape.top_k, self._rng
        picked: dict[int, None] = {}
        while len(picked) < k:
            if rng.random() < self.affinity:
                for e in rng.choice(self._groups[layer]):
                    if len(picked) < k:
                        picked[e] = None
            else:
                picked[rng.randrange(self.shape.experts)] = None
        return list(picked)

    def route_batch(self, tokens: int, layer: int) -> list[list[int]]:
        return [self.route(t, layer) for t in range(tokens)]


class TraceRouter:
    """Replays a routing trace (token -> layer -> expert ids), cycling when it runs out."""

    def __init__(self, trace: Sequence[Mapping[int, Sequence[int]] | Sequence[Sequence[int]]]):
        if not trace:
            raise ValueError("routing trace is empty; record one with --record-routes")
        self._trace = trace

    def route(self, token: int, layer: int) -> list[int]:
        return list(self._trace[token % len(self._trace)][layer])

    def route_batch(self, tokens: int, layer: int) -> list[list[int]]:
        return [self.route(t, layer) for t in range(tokens)]


def make_router(shape: MoEShape, skew: float = 0.0, seed: int = 0, trace=None, group: int = 0,
                affinity: float = 0.0, structure_seed: int = 0):
    """A router: the trace when given, else clustered when ``group`` > 0, else Zipf with
    ``skew`` > 0, else uniform. ``seed`` draws the tokens; ``structure_seed`` the model's hot
    experts and groups, so a recorded trace and a later run see the same model."""
    if trace is not None:
        return TraceRouter(trace)
    if group:
        return ClusteredRouter(shape, group, affinity, seed, structure_seed)
    return ZipfRouter(shape, skew, seed, structure_seed) if skew > 0 else UniformRouter(shape, seed)


def record_trace(router, shape: MoEShape, tokens: int) -> list[dict[int, list[int]]]:
    """Route ``tokens`` tokens through every layer: a trace as placement policies take it."""
    return [{layer: router.route(t, layer) for layer in range(shape.layers)} for t in range(tokens)]
