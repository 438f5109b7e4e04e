"""specserve's OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine."""

# The engine package picks the BLAS library and must be imported before anything imports mlx; every
# server module comes after this package initializer, whatever its own import order.
import engine  # noqa: F401
