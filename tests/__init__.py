# Importing `engine` first selects the optimized BLAS before any test module imports mlx.
import engine  # noqa: F401
