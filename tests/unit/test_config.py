"""tests/unit: no process group. Settings, argument checks, layouts, the tuning cache."""

import pytest
import torch

import asynctp
from asynctp import config
from asynctp.ops import tuning
from asynctp.ops.layout import gather_layout, scatter_layout
from asynctp.ops.validate import check_all_gather_matmul, check_matmul_reduce_scatter


def test_timeout_env_and_override(monkeypatch):
    monkeypatch.setattr(config, "_current", None)  # read the environment afresh
    monkeypatch.setenv("ASYNCTP_TIMEOUT", "12.5")
    assert config.get_timeout() == 12.5
    monkeypatch.setenv("ASYNCTP_TIMEOUT", "99")
    assert config.get_timeout() == 12.5  # read once
    asynctp.set_timeout(3)
    assert config.get_timeout() == 3.0
    asynctp.set_timeout(None)  # back to the environment's
    assert config.get_timeout() == 99.0
    with pytest.raises(ValueError, match="positive"):
        asynctp.set_timeout(0)


@pytest.mark.parametrize("raw", ["soon", "inf", "nan", "0", "-1", "1e999"])
def test_bad_timeouts_name_the_variable(raw):
    with pytest.raises(ValueError, match=f"ASYNCTP_TIMEOUT requires a finite number of seconds > 0, got '{raw}'"):
        config.Config.from_env({"ASYNCTP_TIMEOUT": raw})
    with pytest.raises(ValueError, match="timeout .ASYNCTP_TIMEOUT. requires"):
        config.Config(timeout=float(raw) if raw != "soon" else raw)


@pytest.mark.parametrize("raw, value", [("0", False), ("false", False), ("OFF", False), ("no", False),
                                        ("1", True), ("true", True), ("On", True), ("yes", True), ("", False)])
def test_booleans(raw, value):
    assert config.Config.from_env({"ASYNCTP_CHECK_FINITE": raw}).check_finite is value


@pytest.mark.parametrize("var, raw", [("ASYNCTP_CHECK_CALLS", "maybe"), ("ASYNCTP_DISABLE_SYMM", "2"),
                                      ("ASYNCTP_SM_CARVEOUT", "-3"), ("ASYNCTP_SM_CARVEOUT", "lots"),
                                      ("ASYNCTP_GRAPHS", "sometimes")])
def test_garbage_values_raise_naming_the_variable(var, raw):
    with pytest.raises(ValueError, match=f"{var} requires .*got '{raw}'"):
        config.Config.from_env({var: raw})


def test_config_is_frozen_keyword_only_and_overridable():
    import dataclasses

    cfg = config.get_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.timeout = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.Config(5.0)  # type: ignore[misc]
    assert len(dataclasses.fields(config.Config)) <= 8
    with config.override(check_calls=False, timeout=7):
        assert config.get_config().check_calls is False and config.get_timeout() == 7.0
    assert config.get_config() == cfg
    with pytest.raises(ValueError, match="sm_carveout .ASYNCTP_SM_CARVEOUT. requires an int >= 0"):
        config.configure(sm_carveout=-1)
    assert config.get_config() == cfg


def test_settings_table_documents_every_field():
    import dataclasses

    table = config.settings_table()
    for f in dataclasses.fields(config.Config):
        assert f"`{f.metadata['env']}` | `{f.name}`" in table and f.metadata["doc"]


def test_warn_once():
    with pytest.warns(RuntimeWarning, match="fell back"):
        config.warn_once("unit-test-key", "fell back because of a unit test")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config.warn_once("unit-test-key", "fell back because of a unit test")  # silent the second time


@pytest.mark.parametrize("shape,dim", [((3, 2, 8), 0), ((3, 2, 8), 1), ((3, 2, 8), 2), ((6, 8), 0), ((6, 8), 1)])
def test_gather_layout_round_trip(shape, dim):
    """Stacking R shards' rows and restoring gives torch.cat along the gather dim."""
    world = 3
    shards = [torch.randn(shape) for _ in range(world)]
    lays = [gather_layout(s, dim, world) for s in shards]
    rows = torch.cat([lay.shard_2d for lay in lays])
    assert torch.equal(lays[0].a_gathered(rows), torch.cat(shards, dim=dim))


@pytest.mark.parametrize("shape,dim", [((6, 2, 8), 0), ((3, 6, 8), 1), ((3, 2, 8), 2), ((6, 8), 0), ((6, 8), 1)])
def test_scatter_layout_chunks(shape, dim):
    """Chunk r of the 2-D product, restored, is chunk r of the N-D product along scatter_dim."""
    world = 2
    a, b = torch.randn(shape), torch.randn(shape[-1], 6)
    lay = scatter_layout(a, dim, world)
    full = a @ b
    for r in range(world):
        chunk = lay.a_2d @ b[:, r * 3 : (r + 1) * 3] if lay.n_mode else lay.a_chunk(r) @ b
        torch.testing.assert_close(lay.restore(chunk), full.chunk(world, dim=dim)[r])


def test_checks_name_the_argument():
    a, b = torch.randn(4, 8), torch.randn(8, 6)
    assert check_all_gather_matmul(a, [b], -2, 2, None, "auto")[0] == 0
    with pytest.raises(ValueError, match=r"bs\[0\] requires shape\[0\] == K = 16"):
        check_all_gather_matmul(a, [b], 1, 2, None, "auto")
    with pytest.raises(ValueError, match="scatter_dim 1 requires a size divisible by the world size 4, got 6"):
        check_matmul_reduce_scatter(a, b, 1, 4, "sum", None, "auto")
    with pytest.raises(TypeError, match="gather_dim requires an int, got float"):
        check_all_gather_matmul(a, [b], 0.0, 2, None, "auto")


def test_tuning_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "_current", config.Config(tuning_cache=str(tmp_path / "t.json")))
    monkeypatch.setattr(tuning, "_table", None)
    key = ("bfloat16", 4096, 3584, 8192)
    tuning.record("all_gather_matmul", 2, torch.device("cpu"), key, "serial")
    monkeypatch.setattr(tuning, "_table", None)  # re-read from disk
    assert tuning.load()[tuning._key("all_gather_matmul", 2, torch.device("cpu"), key)] == "serial"


def test_public_api():
    for name in asynctp.__all__:
        assert hasattr(asynctp, name), name


def test_doctor_reports_backend_and_versions():
    from asynctp.doctor import report

    lines = report()
    assert lines[0] == f"torch {torch.__version__}"
    assert any(line.startswith("backend:") for line in lines)
    assert any("multicast" in line for line in lines)
    assert any(line.startswith("fp8 quantization: ") for line in lines)


def test_doctor_names_how_fp8_is_quantized(monkeypatch):
    from asynctp.doctor import _fp8_quantization_line

    assert _fp8_quantization_line(0) == "fp8 quantization: torch ops (CPU)"


def test_compile_subpackage_loads_on_first_use():
    assert callable(asynctp.compile.enable)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        asynctp.nope  # noqa: B018


def test_rule_for_unmeasured_shapes():
    big, small = ("bfloat16", 8192, 3584, 8192), ("bfloat16", 1024, 3584, 8192)
    assert tuning._rule("all_gather_matmul", big) == "fused"
    assert tuning._rule("all_gather_matmul", ("bfloat16", 2048, 3584, 8192)) == "pipeline"
    assert tuning._rule("matmul_reduce_scatter", small) == "serial"
    assert tuning._rule("all_gather_scaled_matmul", ("float8_e4m3fn-rowwise", 8192, 3584, 8192)) == "pipeline"
    assert tuning._rule("scaled_matmul_reduce_scatter", ("float8_e4m3fn-rowwise", 1024, 8192, 3584)) == "serial"


@pytest.mark.parametrize("order, rows, expected", [
    ("auto", 512, True), ("auto", 511, False), ("auto", 4096, True), ("1", 8, True), ("0", 4096, False),
])
def test_batch_major_order_gate(monkeypatch, order, rows, expected):
    """auto (default): the batch-major order where a rank's run of rows per batch element reaches
    BATCH_MAJOR_MIN_ROWS; "1" / "0" force it; never for a batch of one or the last dim."""
    from asynctp.ops import layout

    assert layout.BATCH_MAJOR_MIN_ROWS == 512 and layout.BATCH_MAJOR == "auto"
    monkeypatch.setattr(layout, "BATCH_MAJOR", order)
    shard = torch.zeros(3, rows, 4)
    assert (gather_layout(shard, 1, 2, batch_major=True).segment > 0) == expected
    assert (scatter_layout(torch.zeros(3, 2 * rows, 4), 1, 2, batch_major=True).segment > 0) == expected
    assert gather_layout(shard, 1, 2, batch_major=False).segment == 0  # the serial strategy's order
    assert gather_layout(torch.zeros(1, rows, 4), 1, 2, batch_major=True).segment == 0
    assert gather_layout(shard, 2, 2, batch_major=True).segment == 0


def test_no_module_reads_the_environment_but_config():
    """One configuration: asynctp's settings are read in asynctp/config.py only."""
    import pathlib
    import re

    root = pathlib.Path(asynctp.__file__).parent
    readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if re.search(r"os\.environ\.get\(.ASYNCTP_|getenv\(.ASYNCTP_", p.read_text()))
    assert readers == [], readers
