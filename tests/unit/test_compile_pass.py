"""tests/unit: installing the pass (enable / disable / enabled, chaining with a pass already
installed, the cache uuid), the fusion report and its log, and fail_if_unfused, including one
real torch.compile on a one-process "fake" group."""

from __future__ import annotations

import logging

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import asynctp.config
import asynctp.compile as atc
from asynctp.compile.rewrite import graph_kind
from tests import cases_compile as cc


@pytest.fixture(scope="module", autouse=True)
def fake_world():
    with cc.fake_group(2) as group:
        yield group


@pytest.fixture(autouse=True)
def clean_config():
    was = inductor_config.post_grad_custom_post_pass
    atc.fusion_report(clear=True)
    yield
    inductor_config.post_grad_custom_post_pass = was
    atc.fusion_report(clear=True)


class Recorder(CustomGraphPass):
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, graph) -> None:
        self.calls += 1

    def uuid(self):
        return "recorder-v1"


def ours(value):
    return [p for p in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(p, atc.AsyncTPPass)]


def test_enable_disable_and_context_manager():
    inductor_config.post_grad_custom_post_pass = None
    p = atc.enable()
    assert ours(inductor_config.post_grad_custom_post_pass) == [p] and not p.fail_if_unfused
    p2 = atc.enable(fail_if_unfused=True)  # replaces, never stacks
    assert ours(inductor_config.post_grad_custom_post_pass) == [p2]
    atc.disable()
    assert inductor_config.post_grad_custom_post_pass is None
    with atc.enabled(fail_if_unfused=True) as p3:
        assert ours(inductor_config.post_grad_custom_post_pass) == [p3] and p3.fail_if_unfused
    assert inductor_config.post_grad_custom_post_pass is None
    with pytest.raises(TypeError, match="fail_if_unfused requires a bool"):
        atc.enable(fail_if_unfused="yes")


def test_chains_with_an_installed_pass():
    rec = Recorder()
    inductor_config.post_grad_custom_post_pass = rec
    p = atc.enable()
    gm = cc.trace(lambda x, w: cc.gather(x, 0) @ w, (4, 8), (8, 6))
    for installed in (inductor_config.post_grad_custom_post_pass if isinstance(
            inductor_config.post_grad_custom_post_pass, list) else [inductor_config.post_grad_custom_post_pass]):
        installed(gm.graph)
    assert rec.calls == 1 and atc.fusion_report().fused
    assert p.uuid() is not None
    atc.disable()
    assert inductor_config.post_grad_custom_post_pass is rec


def test_wraps_an_installed_pass_where_torch_takes_one_pass(monkeypatch):
    from asynctp.compile import graph_pass

    monkeypatch.setattr(graph_pass, "_accepts_lists", lambda: False)
    rec = Recorder()
    inductor_config.post_grad_custom_post_pass = rec
    p = atc.enable()
    assert inductor_config.post_grad_custom_post_pass is p and p.wrapped == (rec,)
    assert atc.enable().wrapped == (rec,)  # enabling again does not wrap the wrapper
    gm = cc.trace(lambda x, w: cc.gather(x, 0) @ w, (4, 8), (8, 6))
    inductor_config.post_grad_custom_post_pass(gm.graph)
    assert rec.calls == 1 and atc.fusion_report().fused
    atc.disable()
    assert inductor_config.post_grad_custom_post_pass is rec


def test_uuid_tracks_settings():
    a, b = atc.AsyncTPPass(False).uuid(), atc.AsyncTPPass(True).uuid()
    assert a == atc.AsyncTPPass(False).uuid() and a != b
    with asynctp.config.override(disable_symm=True):  # changes what the pass fuses
        assert atc.AsyncTPPass(False).uuid() != a
    assert atc.AsyncTPPass(False, (lambda g: None,)).uuid() is None  # an opaque wrapped pass: no caching
    assert atc.AsyncTPPass(False, (Recorder(),)).uuid() is not None


def test_report_is_kept_and_logged(caplog):
    gm = cc.trace(lambda x, w: torch.relu(cc.gather(x, 0)) @ w, (4, 8), (8, 6))
    with caplog.at_level(logging.INFO, logger="asynctp.compile"):
        atc.AsyncTPPass()(gm.graph)
    report = atc.fusion_report()
    assert len(report.graphs) == 1 and len(report.unfused) == 1
    text = str(report)
    assert "gather feeds no matmul" in text and "1 not fused" in text
    assert "gather feeds no matmul" in caplog.text
    assert atc.fusion_report(clear=True).graphs and not atc.fusion_report().graphs


def test_fail_if_unfused_raises_with_the_report():
    gm = cc.trace(lambda a: cc.reduce_scatter(a * 2, 0), (4, 8))
    with pytest.raises(atc.UnfusedCollectiveError, match="not a matmul"):
        atc.AsyncTPPass(fail_if_unfused=True)(gm.graph)
    # a gathered weight (as FSDP gathers parameters) is reported but is not a TP collective
    gm = cc.trace(lambda x, w: x @ cc.gather(w, 0), (4, 8), (4, 6))
    atc.AsyncTPPass(fail_if_unfused=True)(gm.graph)


def test_graph_kind():
    gm = cc.trace(lambda x, y, z: x + y + z, (2,), (2,), (2,))
    assert graph_kind(gm.graph) == "inference"
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, ["primals_1", "primals_2", "primals_3"]):
        node.name = name
    assert graph_kind(gm.graph) == "forward"
    placeholders[2].name = "tangents_1"
    assert graph_kind(gm.graph) == "backward"


def test_torch_compile_runs_the_pass_and_fails_loudly():
    import torch._dynamo

    def f(x):
        return torch.relu(cc.gather(x, 0)).sum()

    torch._dynamo.reset()
    try:
        with cc.fresh_compiles(), atc.enabled(fail_if_unfused=True):
            with pytest.raises(Exception, match="gather feeds no matmul"):
                torch.compile(f)(torch.randn(4, 8))
    finally:
        torch._dynamo.reset()
    (graph,) = atc.fusion_report().graphs
    assert graph.kind == "inference" and not graph.records[0].fused
