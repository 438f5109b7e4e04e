"""specserve engine: paged KV cache, continuous batching and speculative decoding on MLX."""

from engine.blas import select_blas as _select_blas

# Must run before the first `import mlx` anywhere in the process (see engine/blas.py).
_select_blas()

__version__ = "0.1.0"
