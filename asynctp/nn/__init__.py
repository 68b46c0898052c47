"""Autograd functions for tensor-parallel linears whose forward and backward overlap communication."""

from asynctp.nn.column_parallel import all_gather_linear
from asynctp.nn.row_parallel import linear_reduce_scatter

__all__ = ["all_gather_linear", "linear_reduce_scatter"]
