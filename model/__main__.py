"""Command line for model bundles: build the default one, convert a stock state_dict, print a manifest.

  python -m model default --out DIR [--seed N]
  python -m model convert --state-dict FILE.pt --config CONFIG.json --out DIR --name N --version V
                          [--key-map stock|article_mha|article_einsum|FILE.json|FILE.toml] [--var NAME=VALUE ...]
                          [--reference module.py:factory [--atol 1e-5]]   # checked before it is kept
  python -m model check DIR --reference module.py:factory [--atol 1e-5]   # exit 1 over the tolerance
  python -m model convert-hf --model-dir HF_DIR --out DIR [--name N --version V]
  python -m model compile-aoti DIR [--dtype float32] [--device cpu] [--max-batch-size 64]   # adds model.pt2
  python -m model info DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from model.bundle import MANIFEST_FILE, MODEL_FILE, BundleError, read_manifest, save_bundle
from model.config import EncoderConfig
from model.convert import ConversionError, KeyMap, builtin_names, convert, load_state_dict_file
from model.default import DEFAULT_NAME, DEFAULT_VERSION, build_default_bundle
from model.hf import ids_only_note
from model.hf_folder import convert_hf_folder


def _check_out(directory: Path) -> None:
    """--out must be a new or an empty directory: checked before any work, so a refusal costs nothing."""
    if directory.exists() and not directory.is_dir():
        raise ConversionError(f"--out {directory} is a file; give a new or empty directory")
    if directory.is_dir():
        entries = sorted(p.name for p in directory.iterdir())
        if entries:
            raise ConversionError(f"--out {directory} is not empty (it holds {', '.join(entries[:5])}"
                                  f"{', ...' if len(entries) > 5 else ''}); give a new or empty directory")


def _default(args: argparse.Namespace) -> dict[str, object]:
    return build_default_bundle(args.out, seed=args.seed).to_dict()


def _convert(args: argparse.Namespace) -> dict[str, object]:
    try:
        config = EncoderConfig.from_json(Path(args.config).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConversionError(f"cannot read the config {args.config}: {e}") from e
    except ValueError as e:
        raise ConversionError(f"{args.config}: {e}") from e
    except RecursionError:
        raise ConversionError(f"{args.config}: EncoderConfig JSON is malformed: nested too deeply") from None
    keymap = KeyMap.builtin(args.key_map) if args.key_map in builtin_names() else KeyMap.load(args.key_map)
    variables = dict(_parse_var(v) for v in args.var)
    # The stock flags are its vars under their historical names.
    for var, value in (("embedding", args.embedding_prefix), ("encoder", args.encoder_prefix),
                       ("position_key", args.position_key)):
        if value is not None:
            variables[var] = value
    keymap = keymap.with_vars(**variables)
    if keymap.name == "stock" and config.positional == "learned" and not keymap.vars.get("position_key"):
        raise ConversionError("positional='learned' needs --position-key: the state_dict key of the "
                              "(max_length, d_model) position table (the stock modules have none)")
    encoder = convert(load_state_dict_file(args.state_dict), config, keymap, strict=args.strict)
    source = f"state_dict:{Path(args.state_dict).name}"
    if keymap.name != "stock":
        source += f",key_map:{keymap.name if args.key_map in builtin_names() else Path(args.key_map).name}"
    manifest = save_bundle(encoder, args.out, name=args.name, version=args.version, source=source)
    if args.reference:
        from model.check import check_bundle, load_reference

        try:
            result = check_bundle(args.out, load_reference(args.reference)(), atol=args.atol)
            failure = None if result.ok else (f"the converted bundle differs from the reference {args.reference} "
                                              f"by {result.worst:.3g} (> --atol {args.atol}); no bundle written")
        except BaseException:
            _remove_bundle(args.out)
            raise
        if failure:
            _remove_bundle(args.out)
            raise ConversionError(failure)
    return manifest.to_dict()


def _convert_hf(args: argparse.Namespace) -> dict[str, object]:
    manifest = convert_hf_folder(args.model_dir, args.out, name=args.name, version=args.version)
    if manifest.text is None:  # a folder without tokenizer.json: said on stderr, the manifest stays stdout's
        print(f"note: {ids_only_note(args.model_dir)}", file=sys.stderr)
    return manifest.to_dict()


def _remove_bundle(directory: Path) -> None:
    for name in (MANIFEST_FILE, MODEL_FILE):  # manifest first: a directory with one is a complete bundle
        (directory / name).unlink(missing_ok=True)


def _parse_var(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ConversionError(f"--var takes NAME=VALUE, got {text!r}")
    return name, value


def _check(args: argparse.Namespace) -> dict[str, object]:
    from model.check import check_bundle, load_reference

    result = check_bundle(args.directory, load_reference(args.reference)(), atol=args.atol, seed=args.seed)
    args.exit_code = 0 if result.ok else 1
    return {"bundle": str(args.directory), "reference": args.reference, **result.to_dict()}


def _compile_aoti(args: argparse.Namespace) -> dict[str, object]:
    from model.aoti import compile_aoti, describe  # torch.export and Inductor: only this command needs them

    return describe(compile_aoti(args.directory, dtype=args.dtype, device=args.device,
                                 max_batch_size=args.max_batch_size))


def _info(args: argparse.Namespace) -> dict[str, object]:
    return read_manifest(args.directory).to_dict()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m model",
        description="Build, convert and inspect model bundles (model.pt TorchScript + manifest.json). "
        "Each command prints the bundle's manifest as JSON.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("default", help=f"build the seeded default bundle ({DEFAULT_NAME} v{DEFAULT_VERSION})",
                       description="Build the REFERENCE encoder (d_model 256, 4 heads, 4 layers) with weights "
                       "drawn from --seed: the same seed gives bit-identical weights (manifest weights_sha256).")
    p.add_argument("--out", required=True, type=Path, help="directory to create the bundle in (must be empty)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    p.set_defaults(run=_default)

    p = sub.add_parser("convert", help="export another encoder's state_dict through a key map",
                       description="Map a state_dict onto our encoder through a key map (model/convert.py "
                       "documents the format; built-in maps: " + ", ".join(builtin_names()) + ") and save it "
                       "as a bundle. The default map reads nn.Embedding + nn.TransformerEncoder(batch_first=True "
                       "layers): norm_first, activation, layer_norm_eps and positional in --config must match how "
                       "the model was built: a state_dict cannot tell.")
    p.add_argument("--state-dict", required=True, type=Path, help="file written by torch.save(model.state_dict())")
    p.add_argument("--config", required=True, type=Path, help="JSON file of EncoderConfig fields")
    p.add_argument("--out", required=True, type=Path, help="directory to create the bundle in (must be empty)")
    p.add_argument("--name", required=True, help="model name for the manifest")
    p.add_argument("--version", required=True, help="model version for the manifest")
    p.add_argument("--key-map", default="stock",
                   help="a built-in map name or a key map file, .json or .toml (default: stock)")
    p.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                   help="set a key map var (a key prefix, say); repeatable")
    p.add_argument("--embedding-prefix", default=None,
                   help="stock map: state_dict prefix of the nn.Embedding (default: 'embedding.')")
    p.add_argument("--encoder-prefix", default=None,
                   help="stock map: state_dict prefix of the nn.TransformerEncoder (default: 'encoder.'; '' for a "
                   "bare one)")
    p.add_argument("--position-key", default=None,
                   help="stock map: state_dict key of the (max_length, d_model) table, for positional='learned'")
    p.add_argument("--reference", default=None, metavar="MODULE.py:FACTORY",
                   help="check the bundle against your eager model before keeping it (as `check` does); a "
                   "difference over --atol removes it and exits 1")
    p.add_argument("--atol", type=float, default=1e-5, help="tolerance of --reference (default: 1e-5)")
    p.add_argument("--strict", action="store_true",
                   help="also refuse keys outside the map's checked prefixes (default: ignore them, e.g. a task "
                   "head)")
    p.set_defaults(run=_convert)

    p = sub.add_parser("convert-hf", help="export a local Hugging Face BERT folder, tokenizer included (text in)",
                       description="Convert a Hugging Face BERT checkpoint folder (config.json, model.safetensors "
                       "or pytorch_model.bin, tokenizer.json, and the sentence-transformers files when present) "
                       "into a text bundle: the encoder, its tokenizer and its text settings (token limit, "
                       "pooling, normalisation, prompts). A folder without tokenizer.json gives a bundle for token "
                       "ids and embeddings only (a note on stderr says so). What cannot be reproduced exactly is "
                       "refused by name. Nothing is downloaded.")
    p.add_argument("--model-dir", required=True, type=Path, help="local Hugging Face model folder")
    p.add_argument("--out", required=True, type=Path, help="directory to create the bundle in (must be empty)")
    p.add_argument("--name", default="", help="model name for the manifest (default: the folder's name)")
    p.add_argument("--version", default="1", help="model version for the manifest (default: 1)")
    p.set_defaults(run=_convert_hf)


    p = sub.add_parser("check", help="compare a bundle with the eager model it was converted from",
                       description="Run the eager model from --reference and the bundle on random batches of "
                       "mixed lengths, with and without the causal mask, and print the worst difference on real "
                       "positions (JSON). Exit status 1 when it exceeds --atol. The contract of the reference is "
                       "in model/check.py.")
    p.add_argument("directory", type=Path, help="bundle directory")
    p.add_argument("--reference", required=True, metavar="MODULE.py:FACTORY",
                   help="factory() returns the eager model; forward(ids, mask) -> hidden (B, T, d_model)")
    p.add_argument("--atol", type=float, default=1e-5, help="largest accepted absolute difference (default: 1e-5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    p.set_defaults(run=_check)

    p = sub.add_parser("compile-aoti", help="add the compiled AOTInductor artefact (model.pt2) to a bundle",
                       description="Export the bundle's encoder with torch.export (dynamic batch and length) and "
                       "compile it with AOTInductor into DIR/model.pt2, checked against model.pt (1e-5 in fp32), "
                       "and record it in manifest.aoti (file, sha256, dtype, device, torch version). The package "
                       "runs only on this torch version, device type and dtype; the service uses it with "
                       "--backend aoti (docs/performance.md). model.pt stays: it serves every call the compiled "
                       "graph does not cover. Takes a minute or more (a C++ compile).")
    p.add_argument("directory", type=Path, help="bundle directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the serving precision it is compiled for (default: float32 = --precision fp32)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="device type (default: cpu)")
    p.add_argument("--max-batch-size", type=int, default=64,
                   help="largest batch it takes, the service's --max-batch-size (default: 64); larger batches "
                   "run on model.pt")
    p.set_defaults(run=_compile_aoti)

    p = sub.add_parser("info", help="print a bundle's manifest", description="Print DIR/manifest.json, checked.")
    p.add_argument("directory", type=Path, help="bundle directory")
    p.set_defaults(run=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = getattr(args, "out", None)
    created = out is not None and not out.exists()
    try:
        if out is not None:
            _check_out(out)
        result = args.run(args)
    except (BundleError, ConversionError, ValueError, OSError) as e:  # CheckError is a ValueError
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # a refusal leaves nothing behind, not even the directory it made
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return getattr(args, "exit_code", 0)


if __name__ == "__main__":
    sys.exit(main())
