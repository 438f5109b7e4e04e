# Tests are a program: make the process-wide choices (BLAS, malloc) before any test module imports mlx.
from engine import platform

platform.setup()
