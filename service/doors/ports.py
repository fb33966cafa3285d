"""One line for a port a serving process cannot have: which, why, and the setting that moves it (the gRPC,
HTTP, metrics and health ports alike)."""

from __future__ import annotations


def port_error(what: str, host: str, port: int, exc: BaseException | str, setting: str) -> str:
    """One line for a port that cannot be had: which, why, and the setting that moves it."""
    reason = exc if isinstance(exc, str) else (getattr(exc, "strerror", None) or str(exc))
    in_use = "in use" in str(reason).lower() or "held by" in str(reason)
    return (f"{what} port {host}:{port} {'is already in use' if in_use else 'cannot be bound'} ({reason}); "
            f"choose another with {setting}, or stop what holds it")
