"""The memory budget of loaded models (`memory_budget_mb`): a model's size estimated from its bundle before it
is loaded, what the process holds (RSS on CPU, allocated device memory on a GPU), and giving memory back
once a model is unloaded.

The estimate is its weights as they will sit in memory: the tensor storages of its TorchScript files (the
encoder and any task heads; stored uncompressed, fp32), times the copies the runner keeps: one in fp32; in
fp16/bf16 a half-size copy, plus the fp32 one the NaN/Inf retry runs on (`nonfinite_policy` retry). With
`precision` auto it is counted as reduced (the larger of the two on CPU, where warm-up may choose either). An
AOTInductor model.pt2 the runner may load adds its size. Activations are not counted: they are per batch,
bounded by `max_batch_tokens`, and freed after it.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import zipfile
from pathlib import Path

import torch

from model.bundle import AOTI_FILE
from service.config import ServiceConfig

MIB = 1 << 20


def weights_bytes(bundle_dir: str | os.PathLike[str]) -> int:
    """Bytes of the tensor storages in the bundle's TorchScript files (model.pt and the heads' files)."""
    total = 0
    for path in sorted(Path(bundle_dir).rglob("*.pt")):
        try:
            with zipfile.ZipFile(path) as archive:
                total += sum(info.file_size for info in archive.infolist() if "/data/" in info.filename)
        except (OSError, zipfile.BadZipFile):  # not a TorchScript archive: its size is the best guess
            total += path.stat().st_size
    return total


def estimate_bytes(bundle_dir: str | os.PathLike[str], config: ServiceConfig, cuda: bool) -> int:
    """What loading the bundle with `config` (the model's own) will hold, before it is loaded (module docstring)."""
    fp32 = weights_bytes(bundle_dir)
    reduced = config.precision in ("fp16", "bf16") or (config.precision == "auto" and (cuda or config.warmup))
    copies = 1.0 if not reduced else 0.5 + (1.0 if config.nonfinite_policy == "retry" else 0.0)
    compiled = Path(bundle_dir) / AOTI_FILE
    aoti = compiled.stat().st_size if config.backend != "torchscript" and compiled.is_file() else 0
    return int(fp32 * copies) + aoti


def used_bytes(cuda: bool) -> int:
    """What the budget is held against, as measured now: device memory allocated by torch (cuda), else the
    process's resident set."""
    if cuda:
        return int(torch.cuda.memory_allocated())
    return rss_bytes()


def rss_bytes() -> int:
    """The process's resident set size (Linux /proc; elsewhere the peak, from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


def release(cuda: bool) -> None:
    """Give memory freed by an unloaded model back: collect cycles, then return the allocator's free pages
    to the OS (glibc keeps freed heap memory below its trim threshold; malloc_trim returns it), or empty
    torch's CUDA cache. Best effort. A model loaded before the process froze its heap
    (`service.process.freeze_heap`) is in the permanent generation, which collections skip: it is thawed for this
    collection and what survives frozen again (with the objects of the calls in flight now)."""
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
    if cuda:
        torch.cuda.empty_cache()
    if sys.platform == "linux":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
