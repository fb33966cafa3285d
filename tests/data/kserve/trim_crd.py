"""Trim a KServe CRD file to the openAPIV3Schema that tests/deploy/test_kserve_manifests.py validates against.

    python tests/data/kserve/trim_crd.py CRD.yaml OUT.json --tag v0.20.0 --commit SHA --path config/crd/full/X.yaml \
        [--drop spec.canary ...]

Only removals, so what is kept validates exactly as upstream: every `description` (text, no rule), `status`
(the controller's, never in a manifest), and each `--drop` path (dotted property names from the root). The
output records where the schema came from (with the sha256 of the input file) and what was dropped; the test
refuses a manifest that uses a dropped field rather than let it pass unchecked.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml


def strip_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: strip_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def drop(schema: dict[str, Any], dotted: str) -> None:
    *parents, last = dotted.split(".")
    node = schema
    for name in parents:
        node = node["properties"][name]
    del node["properties"][last]  # a KeyError names a path that is not in this release's schema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("crd", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--repository", default="kserve/kserve")
    parser.add_argument("--path", required=True, help="the CRD file's path in the repository")
    parser.add_argument("--tag", required=True)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--drop", action="append", default=[], help="a dotted property path to leave out")
    args = parser.parse_args()

    raw = args.crd.read_bytes()
    crd = yaml.safe_load(raw)
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    schema = strip_descriptions(version["schema"]["openAPIV3Schema"])
    dropped = ["status", *args.drop]
    for path in dropped:
        drop(schema, path)
    out = {
        "source": {"repository": args.repository, "path": args.path, "tag": args.tag, "commit": args.commit,
                   "sha256": hashlib.sha256(raw).hexdigest()},
        "group": crd["spec"]["group"],
        "kind": crd["spec"]["names"]["kind"],
        "version": version["name"],
        "dropped": dropped,
        "openAPIV3Schema": schema,
    }
    args.out.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
