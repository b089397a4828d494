"""The beam reorder of a self-attention cache held in one torch tensor (the CUDA-graph backend's, the
TensorRT backend's and ONNX Runtime's on CUDA)."""

from __future__ import annotations


def move_rows_torch(cache, dst, src, p: int) -> None:
    """Beam reorder of a torch cache (2 x layers, rows, heads, capacity, head_dim), in place: rows `dst`
    take the first p slots of rows `src` (index tensors on the cache's device), for every layer at once.
    The sources are gathered before anything is written, so a source may be a destination too."""
    filled = cache[:, :, :, :p]  # a view: index_copy_ writes through it
    filled.index_copy_(1, dst, filled.index_select(1, src))
