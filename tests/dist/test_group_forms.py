"""group= in every form the ops accept (ProcessGroup, name, 1-D DeviceMesh, (mesh, dim name),
None), and no deprecation warnings from asynctp's own collective calls (gloo, 2 ranks)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import RankPool


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2, backend="gloo")
    yield p
    p.close()


def _group_forms() -> list[str]:
    import asynctp
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    a_shard = torch.arange(8.0).view(4, 2) + 10 * rank
    b = torch.arange(6.0).view(2, 3)
    want = asynctp.all_gather_matmul(a_shard, [b], 0, dist.group.WORLD, strategy="serial")[1][0]
    forms = {"name": dist.group.WORLD.group_name, "mesh": mesh, "mesh+dim": (mesh, "tp"), "none": None}
    for label, group in forms.items():
        got = asynctp.all_gather_matmul(a_shard, [b], 0, group)[1][0]
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=label)
        out = asynctp.matmul_reduce_scatter(want, b.t().contiguous(), 0, group)
        assert out.shape == (4, 2), label
    try:
        asynctp.all_gather_matmul(a_shard, [b], 0, (mesh, "dp"))
    except ValueError as exc:
        return [str(exc)]
    raise AssertionError("an unknown mesh dim name was accepted")


def _no_deprecation_warnings() -> list[str]:
    import asynctp

    rank = dist.get_rank()
    a_shard = torch.arange(8.0).view(4, 2) + rank
    b = torch.ones(2, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asynctp.all_gather_matmul(a_shard, [b], 0, None, strategy="serial")
        asynctp.matmul_reduce_scatter(a_shard, torch.ones(2, 4), 0, None, strategy="serial")
        asynctp.all_gather(a_shard, 0, dist.group.WORLD.group_name)
        asynctp.reduce_scatter(a_shard, 0, dist.group.WORLD.group_name)
    return [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]


def test_group_forms(pool):
    messages = pool.run(_group_forms)
    assert "dim name" in messages[0][0]


def test_no_deprecation_warnings(pool):
    assert pool.run(_no_deprecation_warnings) == [[], []]
