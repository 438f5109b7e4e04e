"""The C kernels of the CPU path (small-M GEMM, paged attention, the MTP draft loop) and their builder."""
