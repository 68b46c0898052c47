"""benchmarks/fold_stacks.py: py-spy's folded stacks summed per thread kind, and what runs below a frame."""

from __future__ import annotations

from tests.scripts import load


def _module():
    return load("fold_stacks")


def test_fold_stacks_sums_threads_and_callees(tmp_path):
    main = "0x1 (libc.so.6);<module> (<string>:1);spawn_main (multiprocessing/spawn.py:122);_rank_main (asynctp/demo/cli.py:210)"
    autograd = "0x2 (libc.so.6);torch::autograd::Engine::thread_main (libtorch_cpu.so)"
    window = tmp_path / "window_0.txt"
    window.write_text("\n".join([
        f"{main};step (train.py:5);backend_impl (torch/_library/custom_ops.py:346);op (asynctp/ops/x.py:9) 7",
        f"{main};step (train.py:5);backend_impl (torch/_library/custom_ops.py:346) 1",
        f"{autograd};apply (torch/autograd/function.py:317);backend_impl (torch/_library/custom_ops.py:346);op (asynctp/ops/x.py:9) 2",
        f"{autograd};pthread_cond_wait (libc.so.6) 30",
        "0x3 (libc.so.6);Thread._bootstrap (threading.py:1030) 5",
        "not a sample line",
    ]) + "\n")
    text = _module().summarize([window], "backend_impl", top=5)
    assert "samples: {'main': 8, 'autograd': 32, 'other': 5}" in text
    assert "     30  (waiting: no Python frame)" in text
    below = text[text.index("-- below"):]
    assert "(10 samples, main and autograd threads)" in below
    assert "      9  op (asynctp/ops/x.py:9)" in below and "      1  (itself)" in below
