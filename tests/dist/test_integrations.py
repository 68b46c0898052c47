"""asynctp.integrations on CPU (gloo, 2 ranks): Hugging Face's LlamaForCausalLM under its own
tp_plan made async (skipped without transformers), and torchtitan 0.3's dist_gemm path (skipped
without torchtitan: its dependencies are too heavy for CI's test extra)."""

from __future__ import annotations

import importlib.util

import pytest

from tests import cases_integrations
from tests.multiprocess import RankPool

DEVICE = "cpu"
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2, backend="gloo")
    yield p
    p.close()


@needs_transformers
def test_hf_llama_matches_single_process(pool):
    out = pool.run(cases_integrations.hf_llama_matches_single_process, DEVICE, timeout=300)
    assert out[0]["loss"] == out[1]["loss"], out
    assert out[0]["fused_gathers"] == 2 * 2, out  # per layer: q/k/v and gate/up share one gather each


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="needs torchtitan >= 0.3")
@pytest.mark.parametrize("float8", [None, "rowwise"], ids=["bf16-path", "fp8-rowwise"])
def test_torchtitan_dist_gemm_on_asynctp(pool, float8):
    sqnr = pool.run(cases_integrations.torchtitan_dist_gemm_matches_unsharded, DEVICE, float8, timeout=300)[0]
    # fp8: the FFN chains two fp8 matmuls (w1 / w3, then w2) and the loss squares the output
    floor = 18.0 if float8 else 100.0
    assert all(v >= floor for v in sqnr.values()), sqnr
