"""The OpenAI-compatible server: ``deltafin serve`` (needs the ``serve`` extra: FastAPI and uvicorn)."""
