"""Jobs over many inputs: ``deltafin batch`` (generation) and ``deltafin classify`` (label probabilities)."""
