"""The one configuration of asynctp: a frozen Config read from the environment once, overridable."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = [
    "Config",
    "get_config",
    "configure",
    "override",
    "settings_table",
    "get_timeout",
    "set_timeout",
    "warn_once",
]

_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


def _setting(env: str, doc: str, **kwargs: Any) -> Any:
    """A Config field with its environment variable and its one line of documentation."""
    return dataclasses.field(metadata={"env": env, "doc": doc}, **kwargs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Process-wide settings. Read from ASYNCTP_* variables at first use (`get_config()`),
    replaced in code with `configure(...)` or, for a block, `override(...)`."""

    # NCCL's default watchdog is 10 min; 300 s is long enough for a slow first call (Triton
    # compilation, workspace growth) and short enough that a dead peer is noticed.
    timeout: float = _setting(
        "ASYNCTP_TIMEOUT", "Seconds any wait on another rank may take before it raises naming the missing ranks "
        "(a stuck wait on the GPU: named in the log, then the CUDA context aborted, or the process ended where calls "
        "queued behind it keep the GPU waiting; docs/reliability.md).", default=300.0)
    check_calls: bool = _setting(
        "ASYNCTP_CHECK_CALLS", "Compare every call's signature across ranks (op, sequence number, shapes, dtypes, "
        "dims, modes) in the values they already exchange; a mismatch raises on every rank.", default=True)
    check_finite: bool = _setting(
        "ASYNCTP_CHECK_FINITE", "Check inputs for NaN/Inf before they are communicated (a host sync per call: "
        "a debugging aid).", default=False)
    graphs: str = _setting(
        "ASYNCTP_GRAPHS", "CUDA graphs of recurring eager calls: auto (where the host is the bottleneck; large "
        "calls within a memory budget), 1 (always) or 0 (never).", default="auto")
    disable_symm: bool = _setting(
        "ASYNCTP_DISABLE_SYMM", "Never use symmetric memory: ops overlap over a send/recv ring or run serially.",
        default=False)
    sm_carveout: int | None = _setting(
        "ASYNCTP_SM_CARVEOUT", "SMs left free for other streams' kernels (NCCL's, the caller's) while a call's "
        "matmuls run: a pipelined call's cuBLAS GEMMs, the single-launch GEMMs' programs (unset: per strategy, 16 "
        "for the ring, 0 otherwise).", default=None)
    tuning_cache: str | None = _setting(
        "ASYNCTP_TUNING_CACHE", "Path of the measured tuning table that strategy='auto' reads "
        "(unset: $XDG_CACHE_HOME/asynctp/tuning.json).", default=None)

    def __post_init__(self) -> None:
        t = self.timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"timeout (ASYNCTP_TIMEOUT) requires a finite number of seconds > 0, got {t!r}")
        object.__setattr__(self, "timeout", float(t))
        for name in ("check_calls", "check_finite", "disable_symm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} ({_env(name)}) requires a bool, got {getattr(self, name)!r}")
        if self.graphs not in ("auto", "0", "1"):
            raise ValueError(f"graphs (ASYNCTP_GRAPHS) requires 'auto', '0' or '1', got {self.graphs!r}")
        c = self.sm_carveout
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 0):
            raise ValueError(f"sm_carveout (ASYNCTP_SM_CARVEOUT) requires an int >= 0 or None, got {c!r}")
        if self.tuning_cache is not None and not isinstance(self.tuning_cache, str):
            raise ValueError(f"tuning_cache (ASYNCTP_TUNING_CACHE) requires a path (str) or None, "
                             f"got {self.tuning_cache!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """The settings given by `environ` (default os.environ); unset or empty means the default."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(f.metadata["env"], "").strip()
            if raw:
                values[f.name] = _parse(f, raw)
        return cls(**values)


def _env(name: str) -> str:
    return next(f.metadata["env"] for f in dataclasses.fields(Config) if f.name == name)


def _parse(f: dataclasses.Field, raw: str) -> Any:
    env, kind = f.metadata["env"], f.type
    if kind == "bool":
        low = raw.lower()
        if low in _ON or low in _OFF:
            return low in _ON
        raise ValueError(f"{env} requires one of {'/'.join(_ON)} (on) or {'/'.join(_OFF)} (off), got {raw!r}")
    if kind == "float":
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{env} requires a finite number of seconds > 0, got {raw!r}")
        return value
    if kind == "int | None":
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(f"{env} requires an integer >= 0, got {raw!r}")
        return value
    if f.name == "graphs":
        low = raw.lower()
        if low not in ("auto", "0", "1"):
            raise ValueError(f"{env} requires auto, 0 or 1, got {raw!r}")
        return low
    return raw


_current: Config | None = None
_lock = threading.Lock()
_warned: set[str] = set()


def get_config() -> Config:
    """The settings in force: the environment's, read at the first call, or what configure() set."""
    config = _current
    if config is None:
        with _lock:
            config = _current if _current is not None else _install(Config.from_env())
    return config


def _install(config: Config) -> Config:
    global _current
    _current = config
    return config


def configure(**fields: Any) -> Config:
    """Replace the named settings for this process (validated as the environment is); returns
    the new Config. configure() with no argument re-reads the environment."""
    base = Config.from_env() if not fields else get_config()
    return _install(dataclasses.replace(base, **fields))


@contextlib.contextmanager
def override(**fields: Any) -> Iterator[Config]:
    """The named settings for the duration of a block (tests), restored afterwards."""
    previous = get_config()
    try:
        yield _install(dataclasses.replace(previous, **fields))
    finally:
        _install(previous)


def settings_table() -> str:
    """The settings as a markdown table (the README's table is generated from this)."""
    rows = ["| variable | Config field | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(Config):
        default = "unset" if f.default is None else str(f.default).lower() if isinstance(f.default, bool) else f.default
        rows.append(f"| `{f.metadata['env']}` | `{f.name}` | {default} | {f.metadata['doc']} |")
    return "\n".join(rows)


def get_timeout() -> float:
    """Seconds any wait on another rank may take (Config.timeout)."""
    return get_config().timeout


def set_timeout(seconds: float | None) -> None:
    """Set Config.timeout for this process (None: back to the environment's value or 300)."""
    if seconds is None:
        configure(timeout=Config.from_env().timeout)
        return
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"set_timeout requires a finite positive number of seconds, got {seconds!r}")
    configure(timeout=seconds)


def warn_once(key: str, message: str) -> None:
    """Warn the first time `key` is seen in this process; a fallback must never be silent."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
