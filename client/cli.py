"""`python -m client`: encode, tokenize, rerank, classify, info, health, plot (attention heatmap) and bench
(closed-loop load).

Exit codes: 0 ok; 1 the server refused or failed (the status is printed on stderr), or not
SERVING for `health`; 2 bad usage or an unreadable input file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from client._args import UsageError, add_connection_arguments, tls_of, token_of
from client.channel import DEFAULT_TIMEOUT_S, SERVICE
from client.cli_tasks import add_task_commands
from client.client import SyncEncoderClient
from client.entropy import entropy_per_head
from client.errors import ClientError
from client.messages import DTYPE_NAMES, EncodeResult, FloatArray, ModelInfo, SparseOptions, SparseVector

# -- inputs and outputs ---------------------------------------------------------------------------


def read_sequences(args: argparse.Namespace) -> list[Any]:
    """--text (repeatable), --ids (repeatable) and/or --file: .json (a list of id lists, or one list),
    .npy (1-D ids, 2-D ids = one row per sequence, 2-D float = one embedding sequence, 3-D float =
    several), or .npz (one sequence per array). Texts come first, in the order given."""
    sequences: list[Any] = list(getattr(args, "text", None) or ())
    sequences += [np.asarray(ids, dtype=np.int64) for ids in args.ids or ()]
    if args.file:
        path = Path(args.file)
        try:
            if path.suffix == ".json":
                data = json.loads(path.read_text())
                if isinstance(data, list) and data and all(isinstance(x, int | float) for x in data):
                    data = [data]
                if not isinstance(data, list):
                    raise UsageError(f"{path}: expected a JSON list of sequences")
                sequences += [np.asarray(item) for item in data]
            elif path.suffix == ".npz":
                with np.load(path) as archive:
                    sequences += [archive[name] for name in archive.files]
            elif path.suffix == ".npy":
                array = np.load(path)
                if array.ndim == 1 or (array.ndim == 2 and array.dtype.kind == "f"):
                    sequences.append(array)
                else:
                    sequences += list(array)
            else:
                raise UsageError(f"{path}: use a .json, .npy or .npz file")
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read {path}: {exc}") from exc
    if not sequences:
        raise UsageError("no input: give --text TEXT or --ids N [N ...] (both repeatable), or --file")
    return sequences


def arrays_of(result: EncodeResult) -> dict[str, npt.NDArray[Any]]:
    """Named output arrays: `pooled` [N, d_model]; `hidden`/`attention`/`sparse_indices`/`sparse_values` for
    one sequence, else `hidden_<i>`/... (lengths differ)."""
    out: dict[str, npt.NDArray[Any]] = {}
    if result.pooled:
        out["pooled"] = np.stack(result.pooled)
    for name, arrays in (("hidden", result.hidden), ("attention", result.attention)):
        for i, array in enumerate(arrays):
            out[name if len(result) == 1 else f"{name}_{i}"] = array
    for i, vector in enumerate(result.sparse):
        suffix = "" if len(result) == 1 else f"_{i}"
        out[f"sparse_indices{suffix}"], out[f"sparse_values{suffix}"] = vector.indices, vector.values
    return out


def result_json(result: EncodeResult) -> dict[str, Any]:
    outputs = []
    for i in range(len(result)):
        entry: dict[str, Any] = {"nonfinite": result.nonfinite[i], "token_count": result.token_counts[i],
                                 "truncated": result.truncated[i], "windows": result.windows[i]}
        if result.tokens:
            entry["tokens"] = result.tokens[i]
            entry["token_ids"] = result.token_ids[i].tolist()
        for name, arrays in (("hidden", result.hidden), ("pooled", result.pooled), ("attention", result.attention)):
            if arrays:
                entry[name] = arrays[i].tolist()
        if result.sparse:
            entry["sparse"] = {"indices": result.sparse[i].indices.tolist(), "values": result.sparse[i].values.tolist()}
        outputs.append(entry)
    return {"request_id": result.request_id, "metadata": asdict(result.metadata), "outputs": outputs}


OUT_SUFFIXES = (".npy", ".npz", ".json")


def check_out(out: Path, suffixes: tuple[str, ...], flag: str = "--out") -> None:
    """Refuse, before any call, an output file that could not be written: its folder missing, or a
    file type we do not write."""
    if out.suffix not in suffixes:
        raise UsageError(f"{flag} {out}: use a {', '.join(suffixes[:-1])}{' or ' if len(suffixes) > 1 else ''}"
                         f"{suffixes[-1]} file")
    folder = out.parent
    if not folder.is_dir():
        raise UsageError(f"{flag} {out}: the folder {folder} does not exist; create it first (mkdir -p {folder})")
    if out.is_dir():
        raise UsageError(f"{flag} {out}: is a folder; give a file name")


def write_result(result: EncodeResult, out: Path) -> str:
    if out.suffix == ".json":
        out.write_text(json.dumps(result_json(result)))
        return f"wrote {out} (JSON, {len(result)} sequence(s))"
    arrays = arrays_of(result)
    if out.suffix == ".npz":
        np.savez(out, **arrays)  # type: ignore[arg-type]
        return f"wrote {out}: " + ", ".join(f"{k} {list(v.shape)}" for k, v in arrays.items())
    if out.suffix == ".npy":
        if len(arrays) != 1:
            raise UsageError(f"{len(arrays)} arrays ({', '.join(arrays)}): use --out FILE.npz or FILE.json, "
                             "or ask for one output (e.g. --pooling mean --no-hidden)")
        ((name, array),) = arrays.items()
        np.save(out, array)
        return f"wrote {out}: {name} {list(array.shape)}"
    raise UsageError(f"--out {out}: use a .npy, .npz or .json file")


def _preview(array: FloatArray, count: int) -> str:
    flat = array.reshape(-1)
    values = ", ".join(f"{v:.4f}" for v in flat[:count])
    return f"[{values}{', ...' if flat.size > count else ''}]"


def _sparse_preview(vector: SparseVector, count: int) -> str:
    """The largest entries first, as id:value."""
    order = vector.values.argsort(kind="stable")[::-1][:count]
    items = ", ".join(f"{vector.indices[j]}:{vector.values[j]:.4f}" for j in order)
    return f"[{items}{', ...' if len(vector) > count else ''}]"


def format_result(result: EncodeResult, count: int = 4) -> str:
    lines = []
    for i in range(len(result)):
        lines.append(f"sequence {i}: {result.token_counts[i]} tokens" + (" (truncated)" if result.truncated[i] else "")
                     + (f" (chunked: {result.windows[i]} windows)" if result.windows[i] else "")
                     + ("  (nonfinite in reduced precision; fp32 re-run)" if result.nonfinite[i] else ""))
        if result.tokens:
            lines.append(f"  tokens    {' '.join(result.tokens[i])}")
        for name, arrays in (("hidden", result.hidden), ("pooled", result.pooled), ("attention", result.attention)):
            if arrays:
                a = arrays[i]
                lines.append(f"  {name:<9} {str(list(a.shape)):<16} {_preview(a, count)}")
        if result.sparse:
            entries = f"{len(result.sparse[i])} entries"
            lines.append(f"  sparse    {entries:<16} {_sparse_preview(result.sparse[i], count)}")
    m = result.metadata
    lines.append(f"model {m.model_name} v{m.model_version} on {m.device} ({m.precision}); queue {m.queue_us / 1e3:.2f} "
                 f"ms, compute {m.compute_us / 1e3:.2f} ms, batch {m.batch_size} x {m.padded_length}"
                 + (", fp32 retry" if m.fp32_retry else ""))
    return "\n".join(lines)


def format_info(info: ModelInfo) -> str:
    rows = [("name", info.name), ("version", info.version), ("checksum", info.checksum),
            ("d_model", info.d_model), ("n_heads", info.n_heads), ("n_layers", info.n_layers),
            ("vocab_size", info.vocab_size), ("max_length", info.max_length), ("positional", info.positional),
            ("precision", info.precision), ("precision_reason", info.precision_reason or "-"), ("device", info.device)]
    if info.batch_budget is not None:
        budget = info.batch_budget
        rows += [("batch.max_batch_tokens", budget.max_batch_tokens), ("batch.reason", budget.reason),
                 ("batch.model_workers", budget.model_workers), ("batch.workers_reason", budget.workers_reason or "-")]
    rows += [(f"limits.{k}", v) for k, v in asdict(info.limits).items()]
    rows += [(f"text.{k}", v) for k, v in asdict(info.text).items()] if info.text else [("text", "not accepted")]
    rows += [("tasks", ", ".join(info.tasks))] + ([("labels", ", ".join(info.labels))] if info.labels else [])
    return "\n".join(f"{k:<30} {v}" for k, v in rows)


# -- commands -------------------------------------------------------------------------------------


def _client(args: argparse.Namespace, timeout: float = DEFAULT_TIMEOUT_S) -> SyncEncoderClient:
    return SyncEncoderClient(args.target, timeout=args.timeout or timeout, tls=tls_of(args), token=token_of(args))


def cmd_encode(args: argparse.Namespace) -> int:
    sequences = read_sequences(args)
    if args.out:
        check_out(Path(args.out), OUT_SUFFIXES)
    with _client(args) as client:
        result = client.encode(sequences, pooling=args.pooling, return_hidden=not args.no_hidden,
                               output_dtype=args.dtype, attention=args.attention, layers=args.layers,
                               heads=args.heads, attention_dtype=args.dtype, causal=args.causal,
                               normalize=args.normalize, prompt_name=args.prompt, truncate=args.truncate,
                               return_tokens=args.tokens, long_inputs=args.long_inputs, stride=args.stride,
                               sparse=_sparse_of(args), request_id=args.request_id)
    if args.out:
        print(write_result(result, Path(args.out)))
    else:
        print(format_result(result, args.preview))
    return 0


def _sparse_of(args: argparse.Namespace) -> SparseOptions | bool:
    """--sparse, or either of its options (which imply it)."""
    if args.sparse_top_k is None and args.sparse_threshold is None:
        return bool(args.sparse)
    return SparseOptions(top_k=args.sparse_top_k or 0, threshold=args.sparse_threshold or 0.0)


def cmd_tokenize(args: argparse.Namespace) -> int:
    if not args.text:
        raise UsageError("give at least one --text")
    with _client(args) as client:
        texts = client.tokenize(args.text, prompt_name=args.prompt, truncate=args.truncate)
    if args.json:
        print(json.dumps([{**asdict(t), "token_count": t.token_count} for t in texts], ensure_ascii=False))
        return 0
    for i, t in enumerate(texts):
        cut = ", truncated" if t.truncated else ""
        print(f"text[{i}]: {t.token_count} tokens{cut}\n  tokens {' '.join(t.tokens)}\n  ids    "
              f"{' '.join(map(str, t.ids))}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    with _client(args) as client:
        info = client.model_info()
    print(json.dumps(asdict(info), indent=2) if args.json else format_info(info))
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    from client.health import probe

    serving, line = probe(args.target, args.service, args.timeout or 2.0, tls_of(args), token_of(args))
    print(line)
    return 0 if serving else 1


def cmd_plot(args: argparse.Namespace) -> int:
    sequences = read_sequences(args)
    out = Path(args.out)
    check_out(out, (".png",))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("plot draws with matplotlib, which is not installed: pip install \"./client[plot]\" "
                         "(or pip install matplotlib)") from None
    ids = sequences[0]
    text = isinstance(ids, str)
    head_mean = args.head == "mean"
    if not head_mean and not args.head.lstrip("-").isdigit():
        raise UsageError(f"--head must be a head index or 'mean'; got {args.head!r}")
    with _client(args) as client:
        info = client.model_info()
        # Checked here, before the forward: the server would refuse a bad layer too, but --entropy asks
        # for every layer, so only this check sees --layer there.
        if not -info.n_layers <= args.layer < info.n_layers:
            raise UsageError(f"--layer {args.layer} not in [-{info.n_layers}, {info.n_layers}): the model has "
                             f"{info.n_layers} layers")
        if not head_mean and not -info.n_heads <= int(args.head) < info.n_heads:
            raise UsageError(f"--head {args.head} not in [-{info.n_heads}, {info.n_heads}): the model has "
                             f"{info.n_heads} heads")
        layers = list(range(info.n_layers)) if args.entropy else [args.layer]  # entropy: every layer and head
        # Over the model's limit: refused as `encode` refuses it, unless --truncate cuts it (the title says so).
        result = client.encode([ids], pooling="none", return_hidden=False, layers=layers,
                               heads="all" if args.entropy or not head_mean else "mean", causal=args.causal,
                               return_tokens=text, truncate=args.truncate)
    every = result.attention[0]  # [L, H or 1, T, T]
    layer = args.layer % info.n_layers
    attention = every[[layer]] if args.entropy else every  # [1, H or 1, T, T]
    if args.entropy and head_mean:
        attention = attention.mean(axis=1, keepdims=True)
    if head_mean:
        weights, head_label = attention[0, 0], "mean of heads"
    else:
        head = int(args.head)
        weights, head_label = attention[0, head], f"head {head % info.n_heads}"
    cut = " (truncated)" if result.truncated[0] else ""
    title = f"{info.name} v{info.version}: layer {layer}, {head_label}" + (" (causal)" if args.causal else "") + cut
    entropy = None
    if args.entropy:
        entropy = entropy_per_head(every, causal=args.causal)
        for layer_i, row in enumerate(entropy):
            print(f"entropy layer {layer_i}: " + " ".join(f"{v:.3f}" for v in row))
    labels: Any = result.tokens[0] if text else ids if ids.ndim == 1 else None
    if cut and labels is not None:
        labels = labels[:weights.shape[0]]
    save_heatmap(weights, labels, title, out, dpi=args.dpi, entropy=entropy)
    print(f"wrote {out}: {title}, {weights.shape[0]} tokens")
    return 0


def save_heatmap(weights: FloatArray, ids: npt.NDArray[Any] | list[str] | None, title: str, out: Path,
                 *, dpi: int = 120, entropy: npt.NDArray[np.float64] | None = None) -> None:
    """Query rows x key columns; tick labels are `position:id` for short token-id inputs, and the tokens
    themselves for text (a list of token strings). With `entropy` ([L, H], client/entropy.py), a second
    panel beside it shows it per layer and head."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = weights.shape[0]
    size = min(4.0 + 0.18 * T, 14.0)
    if entropy is None:
        fig, ax = plt.subplots(figsize=(size + 1.2, size), dpi=dpi)
    else:
        fig, (ax, side) = plt.subplots(1, 2, figsize=(2 * size + 2.4, size), dpi=dpi,
                                       gridspec_kw={"width_ratios": [1, 0.6]})
        grid = side.imshow(entropy, cmap="magma", vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto")
        L, H = entropy.shape
        side.set_xticks(range(H), [str(h) for h in range(H)])
        side.set_yticks(range(L), [str(layer) for layer in range(L)])
        side.set_xlabel("head")
        side.set_ylabel("layer")
        side.set_title("normalised entropy (1 uniform, 0 one-hot)")
        for layer_i in range(L):
            for h in range(H):
                side.text(h, layer_i, f"{entropy[layer_i, h]:.2f}", ha="center", va="center", fontsize=7,
                          color="white" if entropy[layer_i, h] < 0.6 else "black")
        fig.colorbar(grid, ax=side, fraction=0.046, pad=0.04, label="entropy")
    try:
        image = ax.imshow(weights, cmap="viridis", vmin=0.0, interpolation="nearest", aspect="equal")
        if isinstance(ids, list) and T <= 64:
            ax.set_xticks(range(T), ids, rotation=90, fontsize=7)
            ax.set_yticks(range(T), ids, fontsize=7)
            ax.set_xlabel("key (token)")
            ax.set_ylabel("query (token)")
        elif ids is not None and not isinstance(ids, list) and T <= 48:
            labels = [f"{i}:{int(t)}" for i, t in enumerate(ids)]
            ax.set_xticks(range(T), labels, rotation=90, fontsize=7)
            ax.set_yticks(range(T), labels, fontsize=7)
            ax.set_xlabel("key (position:token id)")
            ax.set_ylabel("query (position:token id)")
        else:
            ax.set_xlabel("key position")
            ax.set_ylabel("query position")
        ax.set_title(title)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="attention weight")
        fig.tight_layout()
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)


def cmd_bench(args: argparse.Namespace) -> int:
    from client.load import generated_texts, parse_lengths, read_texts, run_load

    try:
        lengths = parse_lengths(args.lengths if args.lengths else str(args.length))
        source = (read_texts(args.text_file) if args.text_file else
                  generated_texts(256, lengths, args.seed) if args.generated_text else None)
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    duration = args.duration if args.duration is not None or args.requests is not None else 10.0
    try:
        report = asyncio.run(run_load(
            args.target, concurrency=args.concurrency, duration_s=duration, max_requests=args.requests,
            lengths=lengths, sequences_per_request=args.seq_per_call, warmup_s=args.warmup, seed=args.seed,
            attention=args.attention, dtype=args.dtype, pooling=args.pooling, timeout=args.timeout or DEFAULT_TIMEOUT_S,
            connections=args.connections, tls=tls_of(args), token=token_of(args), progress=not args.no_progress,
            stream=args.stream, text_source=source,
        ))
    except ValueError as exc:
        if isinstance(exc, ClientError):
            raise
        raise UsageError(str(exc)) from exc
    print(report.format())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(samples=args.samples), indent=2))
        print(f"wrote {args.json}")
    return 0


# -- parser ---------------------------------------------------------------------------------------


def _input_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", action="append", metavar="TEXT",
                   help="one text (models served with a tokenizer); repeat for several")
    p.add_argument("--ids", type=int, nargs="+", action="append", metavar="ID",
                   help="token ids of one sequence; repeat for several")
    p.add_argument("--file", help="input sequences: .json (list of id lists), .npy or .npz")
    p.add_argument("--causal", action="store_true", help="lookahead mask: position i sees positions <= i")


def build_parser() -> argparse.ArgumentParser:
    invoked = Path(sys.argv[0]).name
    prog = "python -m client" if invoked in ("__main__.py", "-c", "") else invoked  # attention-client, as installed
    parser = argparse.ArgumentParser(prog=prog, description="Command-line client of the attention "
                                     "encoder service: encode, tokenize, rerank, classify, info, health, plot, bench.")
    add_connection_arguments(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dtypes = DTYPE_NAMES  # exactly the library's output_dtype names

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        add_connection_arguments(p, default=argparse.SUPPRESS)  # also accepted after the command
        return p

    p = command("encode", "encode sequences; print shapes and a preview, or write --out")
    _input_arguments(p)
    p.add_argument("--pooling", choices=("none", "mean", "cls", "model"), default=None,
                   help="default: model (the model's own) on a model served with a tokenizer, for text and "
                   "ids alike; none otherwise")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="L2-normalise pooled vectors (default: the model's)")
    p.add_argument("--prompt", default="", help="text: one of the model's named prompts (python -m client info)")
    p.add_argument("--truncate", action="store_true", help="cut sequences over the model's limit (--long-inputs "
                   "truncate)")
    p.add_argument("--long-inputs", choices=("error", "truncate", "chunk"), default=None,
                   help="a sequence longer than the model: refuse it (default), cut it, or encode it in "
                   "overlapping windows")
    p.add_argument("--stride", type=int, default=0, help="--long-inputs chunk: tokens between window starts "
                   "(default: half the window)")
    p.add_argument("--tokens", action="store_true", help="text: show the tokens")
    p.add_argument("--no-hidden", action="store_true", help="do not return hidden states")
    p.add_argument("--attention", action="store_true", help="return attention weights")
    p.add_argument("--layers", type=int, nargs="+", metavar="L", help="attention layers (negative from the end)")
    p.add_argument("--heads", choices=("all", "mean"), default="all")
    p.add_argument("--dtype", choices=dtypes, default="float32", help="wire precision of the outputs")
    p.add_argument("--sparse", action="store_true", help="SPLADE sparse vectors (a model with the sparse task)")
    p.add_argument("--sparse-top-k", type=int, default=None, metavar="K",
                   help="only the K largest sparse entries (implies --sparse) [default all]")
    p.add_argument("--sparse-threshold", type=float, default=None, metavar="X",
                   help="only sparse entries above X (implies --sparse) [default 0: every non-zero one]")
    p.add_argument("--request-id", default="")
    p.add_argument("--out", help="write .npy (one array), .npz or .json instead of printing")
    p.add_argument("--preview", type=int, default=4, help="values shown per array")
    p.set_defaults(run=cmd_encode)

    p = command("tokenize", "the token ids and tokens the served model's tokenizer gives texts (no forward)")
    p.add_argument("--text", action="append", metavar="TEXT", help="one text; repeat for several")
    p.add_argument("--prompt", default="", help="one of the model's named prompts (python -m client info)")
    p.add_argument("--truncate", action="store_true", help="cut text over the model's token limit")
    p.add_argument("--json", action="store_true", help="as JSON: ids, tokens, token_count, truncated per text")
    p.set_defaults(run=cmd_tokenize)

    add_task_commands(command, _client)

    p = command("info", "print the model info and limits")
    p.add_argument("--json", action="store_true", help="as JSON")
    p.set_defaults(run=cmd_info)

    p = command("health", "exit 0 when SERVING, 1 otherwise (default timeout 2 s)")
    p.add_argument("--service", default=SERVICE, help=f"grpc.health.v1 service name [default {SERVICE}]")
    p.set_defaults(run=cmd_health)

    p = command("plot", "attention heatmap PNG of one sequence")
    _input_arguments(p)
    p.add_argument("--layer", type=int, default=-1, help="layer (negative from the end) [default -1]")
    p.add_argument("--head", default="mean", help="head index, or 'mean' [default mean]")
    p.add_argument("--dpi", type=int, default=120)
    p.add_argument("--entropy", action="store_true",
                   help="also draw the normalised attention entropy per layer and head beside the heatmap")
    p.add_argument("--truncate", action="store_true",
                   help="cut a sequence over the model's limit (the title says '(truncated)'); without it such "
                   "a sequence is refused, as encode refuses it")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.set_defaults(run=cmd_plot)

    p = command("bench", "closed-loop load: throughput, latency percentiles, server queue/compute split")
    p.add_argument("--concurrency", type=int, default=8, help="callers, one call in flight each [default 8]")
    p.add_argument("--duration", type=float, help="measured seconds, at most 600 [default 10 unless --requests]")
    p.add_argument("--requests", type=int, help="stop after this many measured calls")
    p.add_argument("--warmup", type=float, default=0.0, help="seconds of unmeasured load first")
    lengths = p.add_mutually_exclusive_group()
    lengths.add_argument("--length", type=int, default=128, help="tokens per sequence [default 128]")
    lengths.add_argument("--lengths", help="LOW:HIGH, uniform lengths")
    p.add_argument("--seq-per-call", type=int, default=1, help="sequences per Encode call [default 1]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention", action="store_true", help="ask for attention weights (all layers)")
    p.add_argument("--dtype", choices=dtypes, default="float32", help="wire precision of the outputs")
    p.add_argument("--pooling", choices=("none", "mean", "cls", "model"), default="none",
                   help="model: the model's own (text models) [default none]")
    texts = p.add_mutually_exclusive_group()
    texts.add_argument("--text-file", metavar="FILE",
                       help="send text: one text per line of FILE (UTF-8), drawn at random; the model must take "
                       "text (cut at its limit)")
    texts.add_argument("--generated-text", action="store_true",
                       help="send generated text: random words, --length/--lengths words per text")
    p.add_argument("--connections", type=int, default=1, help="gRPC connections, callers spread over them")
    p.add_argument("--stream", action="store_true",
                   help="send the callers' requests over one EncodeStream per connection, not one call each")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON")
    p.add_argument("--samples", action="store_true", help="include per-call latencies in --json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ClientError as exc:
        message = cli_words(exc.message)
        field = cli_words(exc.field) if exc.field else None
        where = f" (field {field})" if field and field not in message else ""
        print(f"error: {exc.code}: {message}{where}", file=sys.stderr)
        return 1
    return code


# The server's messages name request fields; the CLI's user knows its flags. Phrases first, then names.
CLI_WORDS: tuple[tuple[str, str], ...] = (
    (r"\bset truncate to cut it\b", "give --truncate to cut it"),
    (r"\btruncate = true\b", "--truncate"),
    (r"\breturn_attention is false\b", "--attention is not given"),
    (r"\bPOOLING_MODEL\b", "--pooling model"),
    (r"\bPOOLING_MEAN\b", "--pooling mean"),
    (r"\bPOOLING_CLS\b", "--pooling cls"),
    (r"\bHEADS_MEAN\b", "--heads mean"),
    (r"\bFLOAT16\b", "--dtype float16"),
    (r"\boutput\.pooling\b", "--pooling"),
    (r"\boutput\.sparse\.top_k\b", "--sparse-top-k"),
    (r"\boutput\.sparse\.threshold\b", "--sparse-threshold"),
    (r"\boutput\.sparse\b", "--sparse"),
    (r"\btop_n\b", "--top-n"),
    (r"\boutput\.normalize\b", "--normalize"),
    (r"\b(?:output\.)?prompt_name\b", "--prompt"),
    (r"\b(?:output|attention)\.dtype\b", "--dtype"),
    (r"\battention\.layers\b", "--layers"),
    (r"\blong_inputs\b", "--long-inputs"),
    (r"\bchunk_stride\b", "--stride"),
)


def cli_words(text: str) -> str:
    """A server message or field name in the CLI's terms: "set truncate" -> "give --truncate",
    chunk_stride -> --stride, long_inputs -> --long-inputs, and so on (`CLI_WORDS`)."""
    for pattern, words in CLI_WORDS:
        text = re.sub(pattern, words, text)
    return text
