"""Compiler settings of the demo's compiled runs: torch's async-TP pass, and each run's own
settings while runs advance in turn (train.train_interleaved)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch.distributed.device_mesh import DeviceMesh


@contextlib.contextmanager
def compile_settings(variant: Any) -> Iterator[None]:
    """The compiler settings of a demo variant's graphs (train.Variant) for runs in turn: torch's
    async-TP pass on for its run and off for the others, asynctp's pass (compiling afresh) for
    its run."""
    import torch._inductor.config as inductor_config

    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(_micro_pipeline_tp=variant.torch_async_tp))
        if variant.asynctp_pass:
            from asynctp.compile import enabled, fresh_compiles

            stack.enter_context(enabled())
            stack.enter_context(fresh_compiles())
        yield


def enable_torch_async_tp(mesh: DeviceMesh) -> None:
    """Inductor's micro-pipeline TP pass (torch's own async TP) for graphs over this mesh."""
    import torch._inductor.config as inductor_config
    import torch.distributed._symmetric_memory as symm_mem

    inductor_config._micro_pipeline_tp = True
    # the pass needs symmetric memory enabled for the group on releases that have this call
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        enable(mesh.get_group().group_name)
