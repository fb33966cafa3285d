"""The optional compiled artefact of a bundle: `torch.export` + AOTInductor (model.pt2), built from the eager Encoder.

    python -m model compile-aoti BUNDLE [--dtype float32] [--max-batch-size 64]

What it covers: Encoder.forward for token ids, no causal mask, no attention weights, every layer, in the dtype
it was compiled for, batches of 1..max_batch_size rows and 1..max_length tokens with at least one real token in
all. Everything else (embeddings in, pairs' token types, causal, attention weights, diagnostics, the fp32
retry of non-finite rows, other precisions, task heads) runs on model.pt, which every bundle keeps.

The compiled graph is `PackedForward`: the padded (B, T) batch with its packing (model.encoder.packing) as
inputs, computed on the host by the caller (model.bundle.CompiledForward), so the position-wise layers run on
the real tokens alone as Encoder.forward's packed path does, in one graph whatever the padding (torch.export
cannot branch on host lengths: the TorchScript module chooses packed, masked or unmasked per batch). Padded
rows of its output are zeros; outputs on real positions equal model.pt's within 1e-5 in fp32 (checked here
before the artefact is kept, and on every load against model.pt).

An AOTInductor package is native code for one torch version, one device type and one dtype: the manifest's
`aoti` entry records them with the file's sha256 (model/bundle.py refuses a mismatch by name).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from model.bundle import (
    AOTI_FILE,
    DTYPES,
    FAULT_MODEL_NAME,
    MANIFEST_FILE,
    AotiArtefact,
    BundleError,
    CompiledForward,
    Manifest,
    _write_atomic,
    file_sha256,
    load_compiled,
    read_manifest,
    scripted_parameters,
    weights_sha256,
)
from model.encoder import Encoder

# What compile_aoti passes AOTInductor (docs/performance.md): freezing folds the weights into the graph as constants
# (as torch.jit.freeze does for model.pt) so the CPU GEMMs can use prepacked weights; dynamic_threads makes the
# kernels read the thread count at run time (torch.set_num_threads, which the runner sets per batch) rather than
# keep the compiling process's.
INDUCTOR_CONFIGS: dict[str, Any] = {"freezing": True, "cpp.dynamic_threads": True}
DEFAULT_MAX_BATCH_SIZE = 64  # service/config.py's max_batch_size default
_FP32_ATOL = 1e-5


class PackedForward(nn.Module):
    """Encoder.forward's packed path for token ids (not causal, no attention weights), with the packing as inputs:
    ids (B, T) int64, lengths (B,) int64, tokens (N,) and grid (B, T) from `model.encoder.packing(lengths, T)`
    (grid reshaped). Returns hidden (B, T, d_model) in the module's dtype, padded positions zeros."""

    def __init__(self, encoder: Encoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, ids: Tensor, lengths: Tensor, tokens: Tensor, grid: Tensor) -> Tensor:
        enc = self.encoder
        B, T = ids.size(0), ids.size(1)
        x = enc.tok_emb(ids)
        if enc.has_positions:
            x = x + enc.pos_emb[enc.position_offset:enc.position_offset + T]
        x = enc.ln_emb(x)
        positions = torch.arange(T, device=x.device)
        mask = (positions[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, T)
        flat_grid = grid.reshape(B * T)
        packed = (tokens, flat_grid)
        x = x.reshape(B * T, enc.d_model).index_select(0, tokens)
        bias: Tensor | None = None
        if enc.has_rel_bias:
            bias = enc.rel_bias[:, :T, :T]
        if enc.bucketed:
            bias = nn.functional.embedding(enc.bucket_index[:T, :T], enc.rel_buckets).permute(2, 0, 1)
        if enc.alibi:
            slopes = torch.tensor(enc.alibi_slopes, dtype=torch.float32, device=x.device)
            distance = (positions[None, :] - positions[:, None]).abs().float()
            bias = -slopes[:, None, None] * distance
        local_mask: Tensor | None = None
        if enc.local_radius > 0:
            local_mask = mask & ((positions[None, :] - positions[:, None]).abs() <= enc.local_radius)
        for block in enc.blocks:
            x, _ = block(x, mask, False, False, packed, bias, False, local_mask)
        x = enc.ln_f(x)
        out: Tensor = x.index_select(0, flat_grid).view(B, T, enc.d_model).masked_fill(~mask[:, 0, -1, :, None], 0.0)
        return out


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    # torch 2.13's export warns about its own use of a deprecated pytree API, once per export.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        yield


def eager_encoder(directory: Path, manifest: Manifest) -> Encoder:
    """The bundle's Encoder, rebuilt from its config with model.pt's parameters (checked against the manifest)."""
    if manifest.name == FAULT_MODEL_NAME:
        raise BundleError(f"{directory}: a fault bundle runs custom ops; it has no compiled form")
    params = scripted_parameters(directory)
    encoder = Encoder(manifest.config)
    try:
        encoder.load_state_dict(params, strict=True)
    except RuntimeError as e:
        raise BundleError(f"{directory}/model.pt is not our plain Encoder (a wrapper module?); compile-aoti "
                          f"rebuilds the Encoder from the config and cannot take its weights: {e}") from None
    if weights_sha256(encoder) != manifest.weights_sha256:
        raise BundleError(f"{directory}: the rebuilt encoder's weights differ from the manifest's weights_sha256")
    return encoder.eval()


def compile_aoti(directory: str | os.PathLike[str], *, dtype: str = "float32", device: str = "cpu",
                 max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
                 inductor_configs: dict[str, Any] | None = None) -> Manifest:
    """Export the bundle's encoder with dynamic batch (1..max_batch_size), length (1..max_length) and token count,
    compile it with AOTInductor into DIR/model.pt2, check it against model.pt, and record it in the manifest
    (replacing an earlier model.pt2). Returns the new manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if dtype not in DTYPES:
        raise BundleError(f"--dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if max_batch_size < 1:
        raise BundleError(f"--max-batch-size must be at least 1, got {max_batch_size}")
    if device != "cpu" and not (device == "cuda" and torch.cuda.is_available()):
        raise BundleError(f"--device must be cpu, or cuda where a GPU is visible; got {device!r}")
    encoder = eager_encoder(directory, manifest).to(device=device, dtype=DTYPES[dtype])
    wrapper = PackedForward(encoder).eval()
    max_length = manifest.config.max_length
    ids, lengths, tokens, grid = CompiledForward.inputs(*_example(manifest, min(2, max_batch_size)), device)
    B = torch.export.Dim("B", min=1, max=max_batch_size)
    T = torch.export.Dim("T", min=1, max=max_length)
    N = torch.export.Dim("N", min=1, max=max_batch_size * max_length)
    shapes = {"ids": {0: B, 1: T}, "lengths": {0: B}, "tokens": {0: N}, "grid": {0: B, 1: T}}
    started = time.perf_counter()
    tmp = directory / (".tmp-" + AOTI_FILE)  # aoti_compile_and_package wants a name ending in .pt2
    try:
        with torch.inference_mode(False), torch.no_grad(), _quiet_export():
            exported = torch.export.export(wrapper, (ids, lengths, tokens, grid), dynamic_shapes=shapes)
            from torch._inductor import aoti_compile_and_package

            aoti_compile_and_package(exported, package_path=str(tmp),
                                     inductor_configs={**INDUCTOR_CONFIGS, **(inductor_configs or {})})
    except BundleError:
        raise
    except Exception as e:  # export or compile failed: say which model and why, keep the bundle as it was
        tmp.unlink(missing_ok=True)
        raise BundleError(f"{directory}: torch.export / AOTInductor could not compile the encoder: "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    seconds = time.perf_counter() - started
    artefact = AotiArtefact(file=AOTI_FILE, sha256=file_sha256(tmp), dtype=dtype, device=device,
                            torch=torch.__version__, max_batch_size=max_batch_size, max_length=max_length,
                            compile_seconds=round(seconds, 1))
    try:
        # Checked as the service will load it, against model.pt (BundleError over 1e-5 in fp32).
        compiled = load_compiled(directory, dataclasses.replace(manifest, aoti=dataclasses.replace(
            artefact, file=tmp.name)), device=device, dtype=dtype)
        _check_against_eager(compiled, wrapper, manifest, device)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, directory / AOTI_FILE)
    manifest = dataclasses.replace(manifest, aoti=artefact)
    _write_atomic(directory / MANIFEST_FILE, (json.dumps(manifest.to_dict(), indent=2) + "\n").encode())
    return manifest


def _example(manifest: Manifest, rows: int) -> tuple[Tensor, Tensor]:
    """A padded example batch for export: `rows` rows of min(16, max_length) tokens, the last one shorter."""
    c = manifest.config
    t = max(2, min(16, c.max_length))
    ids = torch.randint(0, max(1, c.vocab_size // 2), (rows, t), generator=torch.Generator().manual_seed(0))
    lengths = torch.full((rows,), t, dtype=torch.int64)
    lengths[-1] = max(1, t // 2)
    return ids, lengths


def _check_against_eager(compiled: CompiledForward, wrapper: PackedForward, manifest: Manifest, device: str) -> None:
    """The compiled module equals the eager wrapper on shapes other than the export's (within the dtype's bound)."""
    c = manifest.config
    g = torch.Generator().manual_seed(7)
    worst = 0.0
    for rows, t in ((1, 1), (3, min(c.max_length, 9)), (min(5, compiled.max_batch_size), c.max_length)):
        rows = min(rows, compiled.max_batch_size)
        ids = torch.randint(0, max(1, c.vocab_size // 2), (rows, t), generator=g)
        lengths = torch.randint(1, t + 1, (rows,), generator=g)
        lengths[0] = t
        got = compiled(ids.to(device), lengths)
        with torch.inference_mode():
            want = wrapper(*CompiledForward.inputs(ids, lengths, device))
        worst = max(worst, float((got.float() - want.float()).abs().max()))
    bound = _FP32_ATOL if compiled.dtype == "float32" else 1e-2
    if not worst <= bound:
        raise BundleError(f"the compiled encoder differs from the eager one by {worst:.3g} (> {bound})")


def describe(manifest: Manifest) -> dict[str, Any]:
    """The manifest's aoti entry (the command's output)."""
    return {"bundle": manifest.name, "aoti": None if manifest.aoti is None else dataclasses.asdict(manifest.aoti)}
