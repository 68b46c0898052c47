"""The single-launch GPU path (strategy="fused": copy-engine pushes, one persistent GEMM that
waits per chunk on the GPU) against the serial reference at world size = all local GPUs."""

from tests import cases_fused


def test_fused_all_gather_exact(pool):
    assert pool.run(cases_fused.fused_all_gather_exact)[0] == 12


def test_fused_all_gather_gemm_stores_rows(pool):
    assert pool.run(cases_fused.fused_all_gather_gemm_stores_rows)[0] == 4


def test_fused_reduce_scatter_matches_serial(pool):
    assert pool.run(cases_fused.fused_reduce_scatter_matches_serial)[0] == 8


def test_fused_random_bf16_close_to_serial(pool):
    assert pool.run(cases_fused.fused_random_bf16_close_to_serial)[0] == 2


def test_fused_scaled_reduce_scatter_exact(pool):
    assert pool.run(cases_fused.fused_scaled_reduce_scatter_exact)[0] == 8


def test_fused_scaled_all_gather_exact(pool):
    assert pool.run(cases_fused.fused_scaled_all_gather_exact)[0] == 8


def test_fused_graph_replays(pool):
    counts = pool.run(cases_fused.fused_graph_replays)
    assert all(c["replayed"] >= 16 for c in counts), counts


def test_fused_in_a_caller_graph(pool):
    assert pool.run(cases_fused.fused_in_a_caller_graph)[0] == 3
