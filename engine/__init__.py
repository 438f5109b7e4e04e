"""specserve engine: paged KV cache, continuous batching and speculative decoding on MLX."""

import os as _os

from engine.blas import select_blas as _select_blas
from engine.malloc import tune_malloc as _tune_malloc

# Before libgomp loads (with the small-M GEMM, engine/blas.py): its workers sleep after a few ms without
# work by default, and the MTP draft loop (engine/spec/mtp_cpu.c) runs ~1.5 ms on one thread between
# target steps; waking them cost the next step ~0.7 ms (6 held-out prompts, one process: draft 1.5 ms
# instead of MLX's 2.9, yet steps only 0.6 ms shorter). Spinning longer (~12 ms here) removes that:
# 1.32x vs 1.27x with MLX drafts. Left alone when the user set either variable.
if "GOMP_SPINCOUNT" not in _os.environ and "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = "1000000"
# Must run before the first `import mlx` anywhere in the process (see engine/blas.py).
_select_blas()
# Before MLX starts threads or allocates buffers: one malloc arena, fixed thresholds (engine/malloc.py).
_tune_malloc()

__version__ = "0.1.0"
