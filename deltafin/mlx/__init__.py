"""The MLX engine: the whole decode and prefill step in MLX (Apple's GPU; MLX's CPU build on Linux, for tests).

``slab``: MLX-owned memory the expert reads land in, and the slots' lifetimes; ``source``: the streaming expert
source over it; ``model``: the families' trunk math in MLX ops; ``engine.open_mlx``: what ``Engine`` calls for
``--device mlx``.
"""
