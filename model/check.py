"""Prove a conversion: run the user's own eager model and the bundle on the same random inputs, report the worst
difference.

The reference is `module.py:factory` (or `package.module:factory`): factory() returns the eager model, weights
loaded, whose forward(ids, mask) takes ids (B, T) int64 and mask bool (B, 1, 1|T, T), True where a query may
attend to a key (the tutorials' `masked_fill(mask == 0, ...)` convention), and returns the hidden states
(B, T, d_model). Inputs mix lengths in one batch (full, half, one token, random), with and without the causal
mask; only real positions are compared; the bundle runs both attention paths (SDPA and the explicit one).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from model.bundle import load_bundle

DEFAULT_ATOL = 1e-5


class CheckError(ValueError):
    """The reference cannot be imported or called as the contract says."""


@dataclass
class CheckResult:
    worst: float = 0.0
    atol: float = DEFAULT_ATOL
    cases: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.worst <= self.atol

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "worst_abs_diff": self.worst, "atol": self.atol, "cases": self.cases}


def load_reference(spec: str) -> Callable[[], torch.nn.Module]:
    """'path/to/module.py:factory' or 'package.module:factory' -> the factory."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise CheckError(f"--reference must be MODULE.py:FACTORY or package.module:FACTORY, got {spec!r}")
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            module_spec = importlib.util.spec_from_file_location(f"_reference_{path.stem}", path)
            if module_spec is None or module_spec.loader is None or not path.is_file():
                raise CheckError(f"{target} is not a Python file")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except CheckError:
        raise
    except Exception as e:  # the user's module failing to import: say which and why
        raise CheckError(f"cannot import {target}: {type(e).__name__}: {e}") from e
    factory = getattr(module, name, None)
    if not callable(factory):
        raise CheckError(f"{target} has no callable {name!r}")
    return factory


def _batches(vocab_size: int, max_length: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for T in sorted({min(max_length, 17), max_length}):
        lengths = torch.tensor([T, max(1, T // 2), 1, int(torch.randint(1, T + 1, (1,), generator=g))])
        ids = torch.randint(0, vocab_size, (len(lengths), T), generator=g)
        out.append((ids, lengths))
    return out


def check_bundle(directory: str | os.PathLike[str], reference: torch.nn.Module, *, atol: float = DEFAULT_ATOL,
                 seed: int = 0) -> CheckResult:
    """Compare the bundle (fp32, CPU) with `reference` on real positions; see the module docstring."""
    bundle = load_bundle(directory)
    config = bundle.manifest.config
    reference = reference.eval()
    result = CheckResult(atol=atol)
    for ids, lengths in _batches(config.vocab_size, config.max_length, seed):
        T = ids.shape[1]
        real = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
        for causal in (False, True):
            mask = real[:, None, None, :]  # (B, 1, 1, T)
            if causal:
                mask = mask & torch.ones(T, T, dtype=torch.bool).tril()  # (B, 1, T, T)
            with torch.inference_mode():
                try:
                    want = reference(ids, mask)
                except Exception as e:
                    raise CheckError(f"the reference failed on ids {tuple(ids.shape)}, mask {tuple(mask.shape)}: "
                                     f"{type(e).__name__}: {e}") from e
                if not isinstance(want, torch.Tensor) or tuple(want.shape) != (*ids.shape, config.d_model):
                    got_shape = tuple(want.shape) if isinstance(want, torch.Tensor) else type(want).__name__
                    raise CheckError(f"the reference must return hidden states {(*ids.shape, config.d_model)}, "
                                     f"got {got_shape}")
                for path, layers in (("sdpa", []), ("explicit", list(range(config.n_layers)))):
                    got, _ = bundle.module(ids, None, lengths, causal, layers)
                    diff = float((got[real].float() - want[real].float()).abs().max())
                    result.cases.append({"T": T, "lengths": lengths.tolist(), "causal": causal, "path": path,
                                         "max_abs_diff": diff})
                    result.worst = max(result.worst, diff)
    return result
