"""The C kernels of the CPU path, a ctypes wrapper beside each .c file, and their builder."""
