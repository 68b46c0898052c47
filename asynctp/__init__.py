"""asynctp: tensor-parallel collectives overlapped with the matmuls that depend on them.

Not public (may change without notice): everything under asynctp.symm other than
Workspace/get_workspace/reserve, the asynctp.ops.* submodules, asynctp.bench and asynctp.demo.
`asynctp.compile` (the torch.compile pass) is imported on first use: it loads inductor.
"""

from asynctp.config import Config, configure, get_config, get_timeout, set_timeout
from asynctp.ops import all_gather_matmul, matmul_reduce_scatter
from asynctp.ops import all_gather_scaled_matmul, scaled_matmul_reduce_scatter
from asynctp.ops import all_gather, reduce_scatter
from asynctp import float8
from asynctp.symm import CallMismatchError, OutOfStepError, PeerTimeoutError, get_workspace, reserve, reset
from asynctp.nn import all_gather_linear, linear_reduce_scatter
from asynctp import parallel

__version__ = "0.1.0"


def __getattr__(name: str):
    # asynctp.compile loads inductor (about a second): only when it is used
    if name == "compile":
        import importlib

        return importlib.import_module("asynctp.compile")
    raise AttributeError(f"module 'asynctp' has no attribute {name!r}")

__all__ = [
    # fused ops (bf16 / fp16 / fp32)
    "all_gather_matmul",
    "matmul_reduce_scatter",
    # fused ops (float8, torch._scaled_mm scales) and the fp8 recipes
    "all_gather_scaled_matmul",
    "scaled_matmul_reduce_scatter",
    "float8",
    # low-contention collectives (copy engines, no SMs but one reduction pass)
    "all_gather",
    "reduce_scatter",
    # training: autograd linears (forward and backward overlapped) and DTensor parallel styles
    "all_gather_linear",
    "linear_reduce_scatter",
    "parallel",
    # workspaces
    "get_workspace",
    "reserve",
    # settings: one Config, read from ASYNCTP_* once, replaced with configure()
    "Config",
    "configure",
    "get_config",
    "get_timeout",
    "set_timeout",
    # reliability: ranks that disagree, fall out of step or time out
    "reset",
    "CallMismatchError",
    "OutOfStepError",
    "PeerTimeoutError",
]
