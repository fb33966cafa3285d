"""The custom ops (namespace attention_faults) that fault bundles call, and the process-wide state they act on.

Imports torch alone, so model.bundle can register the ops before torch.jit.load of a fault bundle and
model.faults (which builds such bundles with model.bundle) can share the state, with no import cycle.
The ops are implemented in Python and run with the GIL; sleep and hang release it.
"""

import threading
import time

import torch
from torch import Tensor

HANG_TIMEOUT_S = 30.0  # read at each HANG, so a test may lower it (monkeypatch model.fault_ops)
HANG_RELEASE = threading.Event()
HANG_ENTERED = threading.Event()
LEAKED: list[bytearray] = []


def reset() -> None:
    """Clear the process-wide fault state (hang events, leaked buffers) between tests."""
    HANG_RELEASE.clear()
    HANG_ENTERED.clear()
    LEAKED.clear()


def _sleep(x: Tensor, ms: int) -> None:
    time.sleep(ms / 1000.0)


def _hang(x: Tensor) -> None:
    HANG_ENTERED.set()
    HANG_RELEASE.wait(timeout=HANG_TIMEOUT_S)


def _leak(x: Tensor, nbytes: int) -> None:
    LEAKED.append(bytearray(b"\xa5") * nbytes)  # filled, so the pages are really resident


def _fail(x: Tensor, message: str, oom: bool) -> None:
    raise (torch.OutOfMemoryError if oom else RuntimeError)(message)


_LIB = torch.library.Library("attention_faults", "DEF")
for _schema, _impl in (
    ("sleep(Tensor x, int ms) -> ()", _sleep),
    ("hang(Tensor x) -> ()", _hang),
    ("leak(Tensor x, int nbytes) -> ()", _leak),
    ("fail(Tensor x, str message, bool oom) -> ()", _fail),
):
    # CONSERVATIVE: the ops return nothing, so with the default alias analysis TorchScript would
    # consider them pure and delete the calls as dead code.
    _LIB.define(_schema, alias_analysis="CONSERVATIVE")
    _LIB.impl(_schema.split("(")[0], _impl, "CompositeExplicitAutograd")
