"""The no-communication baseline: vanilla TP over a fake process group, its collectives replaced by
what one rank's own data gives, so its step does the same compute on real values.

torch's fake process group skips communication, but on torch 2.11 its reduce-scatter and scatter
leave their outputs unwritten: the run computed on uninitialized memory (NaN losses from the first
step), and bf16 GEMMs on such constant bit patterns ran faster than on real data (2xH100, the
8B-shaped block at batch 2: 917 TFLOPS against vanilla TP's 768 on the same shapes), which made
the baseline's step too short and vanilla's communication cost too large. So the parameters are
split locally (every rank built the same full model) and, while the run trains, the functional
collectives over its group are local: an all-gather repeats the input, a reduce-scatter returns
this rank's chunk of it, an all-reduce returns it (local copies; no peer).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["fake_mesh", "local_collectives"]

_FAKE_MESHES: dict[tuple, DeviceMesh] = {}


def fake_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The same ranks as the 1-D `mesh`, over a fake process group. Made once per process
    (new_group is collective: every rank builds its runs in the same order)."""
    import torch.distributed as dist

    ranks = tuple(mesh.mesh.flatten().tolist())
    key = (mesh.device_type, ranks)
    if key not in _FAKE_MESHES:
        try:  # registers the "fake" backend (torch's own test helper)
            import torch.testing._internal.distributed.fake_pg  # noqa: F401
        except ImportError as exc:  # pragma: no cover - every supported release has it
            raise RuntimeError(f"the no-communication baseline requires torch's fake process group, "
                               f"got an import error: {exc}") from exc
        group = dist.new_group(ranks=list(ranks), backend="fake")
        # a dim name of its own: DeviceMesh equality ignores the process group, and DTensor's
        # sharding cache keeps the mesh of the first equal one it saw, so an unnamed fake mesh
        # made after a run over the real one sent its "skipped" collectives over the real group
        _FAKE_MESHES[key] = DeviceMesh.from_group(group, mesh.device_type, mesh_dim_names=("no_comm",))
    return _FAKE_MESHES[key]


@contextlib.contextmanager
def local_collectives(mesh: DeviceMesh) -> Iterator[None]:
    """Within the block, torch's functional collectives (eager, and in compiled graphs) over the
    fake `mesh` run locally; one over any other group raises (the no-communication run has none)."""
    group = mesh.get_group()
    name, rank = group.group_name, group.rank()

    def own(group_name: str) -> None:
        if group_name != name:
            raise RuntimeError(f"the no-communication run requires its collectives on the fake group {name!r}, "
                               f"got one on group {group_name!r}")

    def gather(x: torch.Tensor, n: int, g: str) -> torch.Tensor:
        own(g)
        return torch.cat([x] * n)

    def gather_out(x: torch.Tensor, n: int, g: str, *, out: torch.Tensor) -> torch.Tensor:
        own(g)
        for chunk in out.chunk(n):
            chunk.copy_(x)
        return out

    def scatter(x: torch.Tensor, op: str, n: int, g: str) -> torch.Tensor:
        own(g)
        return x.chunk(n)[rank].clone(memory_format=torch.contiguous_format)

    def scatter_out(x: torch.Tensor, op: str, n: int, g: str, *, out: torch.Tensor) -> torch.Tensor:
        own(g)
        return out.copy_(x.chunk(n)[rank])

    def reduce(x: torch.Tensor, op: str, g: str) -> torch.Tensor:
        own(g)
        return x.clone()

    def reduce_(x: torch.Tensor, op: str, g: str) -> torch.Tensor:
        own(g)
        return x

    impls = {
        "all_gather_into_tensor": gather,
        "all_gather_into_tensor_out": gather_out,
        "all_gather_into_tensor_coalesced": lambda xs, n, g: [gather(x, n, g) for x in xs],
        "reduce_scatter_tensor": scatter,
        "reduce_scatter_tensor_out": scatter_out,
        "reduce_scatter_tensor_coalesced": lambda xs, op, n, g: [scatter(x, op, n, g) for x in xs],
        "all_reduce": reduce,
        "all_reduce_": reduce_,
    }
    with torch.library._scoped_library("_c10d_functional", "IMPL") as lib, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        for op, fn in impls.items():
            if hasattr(torch.ops._c10d_functional, op):
                for key in ("CPU", "CUDA"):
                    lib.impl(op, fn, key)
        yield
