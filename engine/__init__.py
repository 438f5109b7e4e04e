"""specserve engine: paged KV cache, continuous batching and speculative decoding on MLX.

Importing it changes nothing in the process; `engine.platform.setup()` makes the process-wide choices.
"""

__version__ = "0.1.0"
