"""The streaming expert source of the MLX engine: ``StreamingExperts`` whose read buffers are the slots of an
MLX-owned ``ExpertSlab``, so every expert (cached or just read) is a slot of the slab that ``gather_qmm`` reads in
place. The cache, scheduling, replicas, deadlines and checksums are the streaming source's own."""

from __future__ import annotations

from deltafin.mlx.slab import ExpertSlab
from deltafin.runtime.source import StreamingExperts
from deltafin.store.model_dir import PackedModel


class MLXExperts(StreamingExperts):
    def __init__(self, model: PackedModel, cache_bytes: int = 0, threads: int = 4, readers=None,
                 verify: bool = True, deadline=None):
        # no guessed reads: the slab below holds no room for a second layer's read-ahead
        super().__init__(model, cache_bytes, threads, "cpu", readers, verify, deadline=deadline, reserve=False,
                         guess_next=False)
        nbytes = max((model.file_bytes(L) for L in model.moe_layers), default=4096)
        cached = min(self.cache.budget // nbytes, len(model.moe_layers) * model.num_experts)
        # the cache, one layer's every expert (a prefill layer's union, computed in one pass) and the read-ahead
        slots = cached + model.num_experts + min(self.read_ahead, model.num_experts) + 2
        self.mlx_slab = ExpertSlab(slots, nbytes)
        self.pool.buffers = self.mlx_slab

    def slots(self, layer: int, wanted: list[int]) -> tuple[dict[int, int], dict]:
        """Every expert of ``wanted`` in the slab: (expert id -> slot, the layer's role views over the slab)."""
        slot_of, views = {}, None
        for e, tensors in self.fetch(layer, wanted):
            slot_of[e] = self.mlx_slab.slot_of(next(iter(tensors.values())).data)
            views = views or self.mlx_slab.views(tensors)
        assert len(slot_of) == len(wanted), f"expert source returned {len(slot_of)} of {len(wanted)} experts"
        return slot_of, views
