"""What is computed: the fused ops, their serial reference, strategy choice, custom-op registration."""

from asynctp.ops.all_gather_matmul import all_gather_matmul
from asynctp.ops.matmul_reduce_scatter import matmul_reduce_scatter
from asynctp.ops.all_gather_scaled_matmul import all_gather_scaled_matmul
from asynctp.ops.scaled_matmul_reduce_scatter import scaled_matmul_reduce_scatter
from asynctp.ops.collectives import all_gather, reduce_scatter

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "all_gather_scaled_matmul", "scaled_matmul_reduce_scatter",
           "all_gather", "reduce_scatter"]
