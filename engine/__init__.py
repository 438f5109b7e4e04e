"""specserve engine: paged KV cache, continuous batching and speculative decoding on MLX."""

from engine.blas import select_blas as _select_blas
from engine.malloc import tune_malloc as _tune_malloc

# Must run before the first `import mlx` anywhere in the process (see engine/blas.py).
_select_blas()
# Before MLX starts threads or allocates buffers: one malloc arena, fixed thresholds (engine/malloc.py).
_tune_malloc()

__version__ = "0.1.0"
