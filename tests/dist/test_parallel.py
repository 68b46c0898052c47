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


def test_make_async_classic_plan(pool):
    from tests import cases_plans

    out = pool.run(cases_plans.classic_plan_made_async, DEVICE)[0]
    # per block: one gather for wq/wk/wv and one for w1/w3 forward; the head's; no DTensor gathers left
    assert out["fused_calls"] == 2 * 2 + 1, out
    assert out["gathers_vanilla"] > 0 and out["gathers_async"] == 0, out
    assert out["warnings"] == [], out


def test_make_async_names_unconvertible_entries_in_one_warning(pool):
    from tests import cases_plans

    messages = pool.run(cases_plans.unconvertible_entries_warn_once, DEVICE)[0]
    assert len(messages) == 1 and all(f"  {k}:" in messages[0] for k in "abc"), messages


def test_async_colwise_warns_on_replicated_input(pool):
    from tests import cases_plans

    assert len(pool.run(cases_plans.replicated_input_warns, DEVICE)[0]) == 1


def test_demo_no_comm_baseline_after_vanilla_sends_nothing(pool):
    from tests import cases_plans

    if pool.world_size != 2:
        pytest.skip("the tiny demo model splits over 2 ranks")
    assert pool.run(cases_plans.no_comm_run_after_vanilla_sends_nothing) == [[], []]


def test_demo_no_comm_baseline_computes_on_real_values(pool):
    from tests import cases_plans

    if pool.world_size != 2:
        pytest.skip("the tiny demo model splits over 2 ranks")
    for out in pool.run(cases_plans.no_comm_collectives_are_local):
        assert out["gathered"] and out["scattered"] and out["reduced"] and out["real after"]
        assert "requires its collectives on the fake group" in out["real group"]
        assert out["same shards"] and out["finite"]
