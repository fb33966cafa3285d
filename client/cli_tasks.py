"""`python -m client rerank` and `classify`: the task calls of a model served with a reranking or
classification head (docs/tasks.md), printed as a table or as JSON."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from client._args import UsageError
from client.client import SyncEncoderClient
from client.messages import Classification, ClassifyInput, RankedText

OpenClient = Callable[[argparse.Namespace], SyncEncoderClient]
Command = Callable[[str, str], argparse.ArgumentParser]


def _clip(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def format_ranked(ranked: list[RankedText]) -> str:
    lines = [f"{'rank':<5} {'index':<6} {'score':<12} text"]
    for rank, r in enumerate(ranked):
        cut = " (truncated)" if r.truncated else ""
        lines.append(f"{rank:<5} {r.index:<6} {r.score:<12.6f} {_clip(r.text) if r.text is not None else ''}{cut}")
    return "\n".join(lines)


def format_classified(results: list[Classification]) -> str:
    lines = []
    for i, c in enumerate(results):
        scores = "  ".join(f"{label} {score:.6f}" for label, score in c.scores.items())
        cut = " (truncated)" if c.truncated else ""
        lines.append(f"input {i}: {c.label}{cut}\n  {scores}")
    return "\n".join(lines)


def read_lines(path: str) -> list[str]:
    """One text per line of a UTF-8 file (blank lines skipped)."""
    try:
        return [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from exc


def add_task_commands(command: Command, open_client: OpenClient) -> None:
    """The rerank and classify sub-commands, on the parser `command` makes."""

    def cmd_rerank(args: argparse.Namespace) -> int:
        texts = list(args.text or []) + (read_lines(args.file) if args.file else [])
        if not texts:
            raise UsageError("give at least one --text (repeatable) or --file with one text per line")
        with open_client(args) as client:
            ranked = client.rerank(args.query, texts, top_n=args.top_n, raw_scores=args.raw_scores,
                                   return_text=True, truncate=args.truncate)
        print(json.dumps([asdict(r) for r in ranked], ensure_ascii=False) if args.json else format_ranked(ranked))
        return 0

    def cmd_classify(args: argparse.Namespace) -> int:
        if bool(args.text) == bool(args.pair):
            raise UsageError("give --text TEXT or --pair FIRST SECOND (either repeatable), not both")
        inputs: list[ClassifyInput] = list(args.text) if args.text else [(a, b) for a, b in args.pair]
        with open_client(args) as client:
            results = client.classify(inputs, raw_scores=args.raw_scores, truncate=args.truncate)
        if args.json:
            print(json.dumps([{**asdict(c), "label": c.label} for c in results], ensure_ascii=False))
        else:
            print(format_classified(results))
        return 0

    p = command("rerank", "score texts against a query with the served reranker, best first")
    p.add_argument("--query", required=True, help="the query every text is scored against")
    p.add_argument("--text", action="append", metavar="TEXT", help="one text to rank; repeat for several")
    p.add_argument("--file", help="texts to rank, one per line (UTF-8), after any --text")
    p.add_argument("--top-n", type=int, default=None, help="only the best N [default all]")
    p.add_argument("--raw-scores", action="store_true", help="the logits, not sigmoid(logit)")
    p.add_argument("--truncate", action="store_true", help="cut a (query, text) pair over the model's token limit")
    p.add_argument("--json", action="store_true", help="as JSON: index, score, text, token_count, truncated")
    p.set_defaults(run=cmd_rerank)

    p = command("classify", "label scores of texts (or text pairs) from the served classification head")
    p.add_argument("--text", action="append", metavar="TEXT", help="one text; repeat for several")
    p.add_argument("--pair", action="append", nargs=2, metavar=("FIRST", "SECOND"),
                   help="a text pair, encoded as one sequence; repeat for several")
    p.add_argument("--raw-scores", action="store_true", help="the logits, not probabilities")
    p.add_argument("--truncate", action="store_true", help="cut an input over the model's token limit")
    p.add_argument("--json", action="store_true", help="as JSON: scores (label -> score), label, token_count, "
                   "truncated")
    p.set_defaults(run=cmd_classify)
