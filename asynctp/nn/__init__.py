"""Autograd functions for tensor-parallel linears whose forward and backward overlap communication."""

from asynctp.nn.all_gather_linear import all_gather_linear
from asynctp.nn.linear_reduce_scatter import linear_reduce_scatter

__all__ = ["all_gather_linear", "linear_reduce_scatter"]
