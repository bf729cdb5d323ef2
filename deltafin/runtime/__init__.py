"""Runtime: expert cache, streaming expert source, generation, sampling, stats."""
