"""Command line for model bundles: build the default one, convert a stock state_dict, print a manifest.

  python -m model default --out DIR [--seed N]
  python -m model convert --state-dict FILE.pt --config CONFIG.json --out DIR --name N --version V
  python -m model convert-hf --model-dir HF_DIR --out DIR [--name N --version V]
  python -m model info DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from model.bundle import BundleError, read_manifest, save_bundle
from model.config import EncoderConfig
from model.convert import ConversionError, convert_state_dict, load_state_dict_file
from model.default import DEFAULT_NAME, DEFAULT_VERSION, build_default_bundle
from model.hf import HFConversionError, convert_hf


def _default(args: argparse.Namespace) -> dict[str, object]:
    return build_default_bundle(args.out, seed=args.seed).to_dict()


def _convert(args: argparse.Namespace) -> dict[str, object]:
    try:
        config = EncoderConfig.from_json(Path(args.config).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConversionError(f"cannot read the config {args.config}: {e}") from e
    except ValueError as e:
        raise ConversionError(f"{args.config}: {e}") from e
    encoder = convert_state_dict(
        load_state_dict_file(args.state_dict), config, embedding_prefix=args.embedding_prefix,
        encoder_prefix=args.encoder_prefix, position_key=args.position_key, strict=args.strict,
    )
    manifest = save_bundle(encoder, args.out, name=args.name, version=args.version,
                           source=f"state_dict:{Path(args.state_dict).name}")
    return manifest.to_dict()


def _convert_hf(args: argparse.Namespace) -> dict[str, object]:
    encoder, tokenizer, settings, source = convert_hf(args.model_dir)
    name = args.name or Path(args.model_dir).resolve().name
    manifest = save_bundle(encoder, args.out, name=name, version=args.version, source=source,
                           text=(tokenizer, settings))
    return manifest.to_dict()


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

    p = sub.add_parser("convert", help="export a stock nn.Embedding + nn.TransformerEncoder state_dict",
                       description="Map the state_dict of nn.Embedding + nn.TransformerEncoder(batch_first=True "
                       "layers) onto our encoder and save it as a bundle. The key mapping is in model/convert.py. "
                       "norm_first, activation, layer_norm_eps and positional in --config must match how "
                       "the stock model was built: a state_dict cannot tell.")
    p.add_argument("--state-dict", required=True, type=Path, help="file written by torch.save(model.state_dict())")
    p.add_argument("--config", required=True, type=Path, help="JSON file of EncoderConfig fields")
    p.add_argument("--out", required=True, type=Path, help="directory to create the bundle in (must be empty)")
    p.add_argument("--name", required=True, help="model name for the manifest")
    p.add_argument("--version", required=True, help="model version for the manifest")
    p.add_argument("--embedding-prefix", default="embedding.",
                   help="state_dict prefix of the nn.Embedding (default: 'embedding.')")
    p.add_argument("--encoder-prefix", default="encoder.",
                   help="state_dict prefix of the nn.TransformerEncoder (default: 'encoder.'; '' for a bare one)")
    p.add_argument("--position-key", default=None,
                   help="state_dict key of the (max_length, d_model) table, for positional='learned'")
    p.add_argument("--strict", action="store_true",
                   help="also refuse keys outside the two prefixes (default: ignore them, e.g. a task head)")
    p.set_defaults(run=_convert)

    p = sub.add_parser("convert-hf", help="export a local Hugging Face BERT folder, tokenizer included (text in)",
                       description="Convert a Hugging Face BERT checkpoint folder (config.json, model.safetensors "
                       "or pytorch_model.bin, tokenizer.json, and the sentence-transformers files when present) "
                       "into a text bundle: the encoder, its tokenizer and its text settings (token limit, "
                       "pooling, normalisation, prompts). What cannot be reproduced exactly is refused by name. "
                       "Nothing is downloaded.")
    p.add_argument("--model-dir", required=True, type=Path, help="local Hugging Face model folder")
    p.add_argument("--out", required=True, type=Path, help="directory to create the bundle in (must be empty)")
    p.add_argument("--name", default="", help="model name for the manifest (default: the folder's name)")
    p.add_argument("--version", default="1", help="model version for the manifest (default: 1)")
    p.set_defaults(run=_convert_hf)

    p = sub.add_parser("info", help="print a bundle's manifest", description="Print DIR/manifest.json, checked.")
    p.add_argument("directory", type=Path, help="bundle directory")
    p.set_defaults(run=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.run(args)
    except (BundleError, ConversionError, HFConversionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
