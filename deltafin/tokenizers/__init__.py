"""Tokenizers and chat formats, one module per model family (`kimi_k3`, `xtml`)."""
