"""Process-wide settings read from the environment: timeouts and the warn-once registry."""

from __future__ import annotations

import os
import warnings

__all__ = ["get_timeout", "set_timeout", "warn_once"]

_TIMEOUT_ENV = "ASYNCTP_TIMEOUT"
# NCCL's default watchdog is 10 min; 300 s is long enough for a slow first call (Triton
# compilation, workspace growth) and short enough that a dead peer is noticed.
_DEFAULT_TIMEOUT_S = 300.0
_timeout_override: float | None = None
_warned: set[str] = set()


def get_timeout() -> float:
    """Seconds any wait on another rank may take: set_timeout(), else $ASYNCTP_TIMEOUT, else 300."""
    if _timeout_override is not None:
        return _timeout_override
    raw = os.environ.get(_TIMEOUT_ENV)
    if raw is None:
        return _DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{_TIMEOUT_ENV} requires a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{_TIMEOUT_ENV} requires a positive number of seconds, got {raw!r}")
    return value


def set_timeout(seconds: float | None) -> None:
    """Override the timeout for this process (None restores the environment/default)."""
    global _timeout_override
    if seconds is not None and not seconds > 0:
        raise ValueError(f"set_timeout requires a positive number of seconds, got {seconds!r}")
    _timeout_override = None if seconds is None else float(seconds)


def warn_once(key: str, message: str) -> None:
    """Warn the first time `key` is seen in this process; a fallback must never be silent."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
