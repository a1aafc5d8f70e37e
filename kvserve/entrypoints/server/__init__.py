"""The OpenAI-compatible HTTP server (FastAPI) over the async engine."""
