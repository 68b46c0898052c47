"""Triton kernels (no torch.distributed here): the persistent GEMMs whose input rows arrive in
chunks (all-gather -> matmul) or whose output chunks leave as they are done (matmul ->
reduce-scatter), with plain-torch references on CPU that keep the same chunk order."""

from asynctp.kernels.async_input_mm import ChunkMap, async_input_mm, chunk_order
from asynctp.kernels.configs import Config, candidates, pick_config

__all__ = ["async_input_mm", "ChunkMap", "chunk_order", "Config", "candidates", "pick_config"]
