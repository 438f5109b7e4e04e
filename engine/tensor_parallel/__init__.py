"""Tensor parallelism over `mx.distributed`: every rank holds a slice of each layer and of the paged KV, and
rank 0 broadcasts each forward's inputs to the others (docs/scale-out.md)."""
