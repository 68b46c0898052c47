"""SM carve-out for the matmuls of a pipelined call.

cuBLAS's large GEMMs on Hopper are persistent: one block per SM, resident until the GEMM ends.
Any kernel queued behind one on another stream (NCCL's send/recv kernels of the ring; torch's
barrier and signal kernels where those are used: without stream memory operations) waits for the
whole GEMM, and the overlap that the pipeline was built for does not happen. While a pipelined call issues its matmuls, asynctp asks cuBLAS(Lt)
to target `SMs - n` SMs (torch's experimental SM carve-out, honoured by the cuBLASLt path, which
is selected for the duration), so those kernels start at once on the SMs left free.

`ASYNCTP_SM_CARVEOUT=n` overrides the default of each strategy (0 turns it off). The previous
carve-out and BLAS backend are restored when the call returns. The fused strategy's single-launch
GEMMs are persistent too: they run one program per SM less n (`kernels.async_input_mm.programs`;
unset: every SM).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from asynctp.config import get_config

__all__ = ["sm_carveout", "carveout_for"]

# SMs left free per strategy, measured on 2xH200 (M 4096 and 8192, N 3584, K 8192; signals as
# torch's kernels; docs/performance.md): the pipeline gained nothing from it (the GEMMs lost 3-10%
# at 4-16 SMs), the ring's NCCL kernels gained 3-8% over NVLink and 9-22% with peer access off at
# 16 SMs. The pipeline's eager signals are stream memory operations, which need no SM.
_DEFAULTS = {"pipeline": 0, "ring": 16}


def carveout_for(strategy: str) -> int:
    n = get_config().sm_carveout
    return _DEFAULTS.get(strategy, 0) if n is None else n


_get = getattr(torch._C, "_get_sm_carveout_experimental", None)
_set = getattr(torch._C, "_set_sm_carveout_experimental", None)


@contextlib.contextmanager
def sm_carveout(device: torch.device, strategy: str) -> Iterator[None]:
    """GEMMs launched inside leave carveout_for(strategy) SMs free (CUDA only; a no-op elsewhere,
    when the carve-out is 0, or on a torch without the setting)."""
    n = carveout_for(strategy) if device.type == "cuda" else 0
    if n <= 0 or _set is None:
        yield
        return
    prev_n = _get()
    prev_lib = torch._C._get_blas_preferred_backend()
    lt = torch._C._BlasBackend.Cublaslt
    _set(n)
    if prev_lib != lt:
        torch._C._set_blas_preferred_backend(lt)
    try:
        yield
    finally:
        _set(prev_n)
        if prev_lib != lt:
            torch._C._set_blas_preferred_backend(prev_lib)
