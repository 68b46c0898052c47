"""torch.compile FX pass: find all-gather -> matmul and matmul -> reduce-scatter, replace them
with asynctp's fused ops, and report what was (not) fused and why.

    import asynctp.compile
    asynctp.compile.enable()              # or: with asynctp.compile.enabled(): ...
    loss = torch.compile(model)(x)        # graphs compile (and are rewritten) at the first call
    print(asynctp.compile.fusion_report())

Not public: the modules patterns, rewrite, graph_pass, report (import from here).
"""

from asynctp.compile.graph_pass import AsyncTPPass, disable, enable, enabled, fresh_compiles, fusion_report
from asynctp.compile.report import CollectiveRecord, FusionReport, GraphReport, UnfusedCollectiveError

__all__ = [
    # switching the pass on and off
    "enable",
    "disable",
    "enabled",
    # what it did
    "fusion_report",
    "fresh_compiles",
    "FusionReport",
    "GraphReport",
    "CollectiveRecord",
    "UnfusedCollectiveError",
    # the pass object (for passing to inductor yourself)
    "AsyncTPPass",
]
