"""asynctp: tensor-parallel collectives overlapped with the matmuls that depend on them.

Not public (may change without notice): everything under asynctp.symm other than
Workspace/get_workspace/reserve, asynctp.ops.* submodules, asynctp.kernels.
"""

from asynctp.config import get_timeout, set_timeout
from asynctp.ops import all_gather_matmul, matmul_reduce_scatter
from asynctp.symm import get_workspace, reserve

__version__ = "0.1.0"

__all__ = [
    # fused ops (bf16 / fp16 / fp32)
    "all_gather_matmul",
    "matmul_reduce_scatter",
    # workspaces
    "get_workspace",
    "reserve",
    # settings
    "get_timeout",
    "set_timeout",
]
