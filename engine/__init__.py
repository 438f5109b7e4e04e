"""specserve engine: paged KV cache, continuous batching and speculative decoding on MLX.

Importing it changes nothing in the process; `engine.platform.setup()` makes the process-wide choices.
"""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("specserve")  # pyproject.toml holds the version
except _metadata.PackageNotFoundError:  # a checkout that was never installed
    __version__ = "0+unknown"
