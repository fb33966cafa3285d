"""Where and in what precision the model runs: the device and precision a config's `auto` resolves to,
and the defaults that depend on them (intra-op threads, model workers, the batch token budget)."""

from __future__ import annotations

import os

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def default_threads() -> int:
    """Intra-op threads when the config says 0: one per usable core (torch's own default, stated)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def is_cuda(device: str) -> bool:
    """Whether `device` as configured (auto | cpu | cuda) runs on a GPU."""
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def default_batch_tokens(device: str) -> int:
    """The token budget when the config says 0 and warm-up is off (with warm-up it is measured,
    service/tuning.py). On this project's CPU, batches of 1024 tokens ran as fast per token as 2048
    on two threads and faster on one, which each of two workers has (bench/RESULTS.md); a GPU wants more."""
    return 16384 if is_cuda(device) else 1024


def measured_batch_tokens(device: str) -> tuple[int, ...]:
    """The budgets warm-up times when the config says 0 (service/tuning.py chooses among them)."""
    return (2048, 4096, 8192, 16384, 32768) if is_cuda(device) else (128, 256, 512, 1024, 2048, 4096)


def default_workers(device: str, threads: int) -> int:
    """Model workers when the config says 0: two on a CPU with two or more threads (two narrow forwards
    side by side beat one wide one under load, bench/RESULTS.md), one on a GPU (pipelined instead)."""
    return 1 if is_cuda(device) or threads < 2 else 2


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but CUDA is not available")
    return torch.device(name)


def resolve_precision(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"
