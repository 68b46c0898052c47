"""asynctp.parallel styles on the demo's Llama (gloo, cpu backend): sharded vs one process, the
vanilla and async plans' float32 loss curves, and plans the async styles refuse."""

import pytest

from tests import cases_nn

DEVICE = "cpu"


@pytest.mark.parametrize(("asynchronous", "share"), [(False, False), (True, False), (True, True)],
                         ids=["vanilla", "async", "async-shared-gather"])
def test_sharded_model_matches_single_process(pool, asynchronous, share):
    counts = pool.run(cases_nn.styles_match_single_process, DEVICE, asynchronous, share)
    assert counts[0] == 2 * 9 + 3  # per block: 2 norms + 7 linears; embedding, norm, output


def test_float32_loss_curves_identical(pool):
    vanilla, fused = pool.run(cases_nn.loss_curves, DEVICE, 4)[0]
    assert len(vanilla) == 4
    assert vanilla[-1] < vanilla[0]
    assert max(abs(a - b) for a, b in zip(vanilla, fused)) <= 1e-5, (vanilla, fused)


def test_bad_plans_raise_at_parallelize_time(pool):
    messages = pool.run(cases_nn.bad_plans, DEVICE)
    assert all(m == messages[0] for m in messages)


@pytest.mark.parametrize(("share", "expected"), [(True, 2 * 2 + 1), (False, 2 * 5 + 1)], ids=["shared", "per-linear"])
def test_shared_gather_calls(pool, share, expected):
    # per block: wq/wk/wv and w1/w3 (2 shared gathers, else 5), plus the output head
    assert pool.run(cases_nn.gather_calls_per_forward, DEVICE, share)[0] == expected


def test_compiled_styles_share_gathers(pool):
    # per block: the shared wq/wk/wv and w1/w3 gathers forward, the wo and w2 dgrad gathers backward; the head
    assert pool.run(cases_nn.compiled_styles_share_gathers, DEVICE, timeout=600)[0] == 2 * 4 + 1


def test_shared_gather_misuse(pool):
    pool.run(cases_nn.shared_gather_misuse, DEVICE)
