"""Paged-attention and cache-write kernels for Apple GPUs (`mx.fast.metal_kernel`), their launch
planning (`ops`), and a NumPy emulation of their index arithmetic (`emulate`). See metal_kernels/README.md."""
