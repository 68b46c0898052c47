"""tests/gpu: the torch.compile pass on >= 2 GPUs (NCCL, cuda symmetric backend): the tiny
DTensor sequence-parallel block compiled with and without the pass gives the same loss and
gradients (fp32 small integers: exact), and every TP collective is fused in forward and backward;
the fp8 forms (bf16 output, as cuBLAS rowwise requires) give the same result with the pass."""

from tests import cases_compile


def test_compiled_block_same_loss_and_grads(pool):
    results = pool.run(cases_compile.compiled_block_matches, "cuda", timeout=900)
    got = results[0]
    assert all(r["text"] == got["text"] for r in results), "ranks disagree on the fusion report"
    assert got["graphs"] == ["forward", "backward"], got["text"]
    assert got["unfused"] == [], got["text"]
    assert got["ag"] == 4 and got["rs"] == 7, got["text"]
    assert got["matmuls"] == [1, 1, 2, 3], got["text"]


def test_compiled_fp8_same_result(pool):
    got = pool.run(cases_compile.compiled_fp8_matches, "cuda", timeout=600)[0]
    assert got["unfused"] == [], got["text"]
    assert got["ag"] == 2 and got["rs"] == 1, got["text"]
