"""What is computed: the fused ops, their serial reference, strategy choice, custom-op registration."""

from asynctp.ops.all_gather_matmul import all_gather_matmul
from asynctp.ops.matmul_reduce_scatter import matmul_reduce_scatter

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]
