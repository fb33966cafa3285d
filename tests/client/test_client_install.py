"""The client as its own distribution (issue 28 item 1): in a fresh virtual environment outside the
checkout, the documented `pip install ./client` installs the library and the `attention-client` command
without torch or matplotlib, and the command talks to a running server.

The install is the documented command itself, from a copy of the tracked files (so the checkout gets
no build/ folder, and only what git holds goes in), with its dependencies from the package index as a
user gets them: pip's cache makes later runs fast (the first downloads about 25 MB: numpy, grpcio,
protobuf, setuptools for the build). Nothing of the shared environment is visible inside the new one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from importlib import import_module
from pathlib import Path

import pytest

from tests.support.server_process import ServerProcess

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
INSTALL = ["-m", "pip", "install", "--disable-pip-version-check", "./client"]  # docs/client.md, "Install"


def tracked_copy(dest: Path) -> Path:
    """client/ and proto/ as git holds them, under `dest`."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "client", "proto"], capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    return dest


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def test_pip_install_client_in_a_fresh_venv_gives_a_working_command_without_torch(
        tiny_text_bundle: Path, tmp_path: Path) -> None:
    source = tracked_copy(tmp_path / "checkout")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    done = subprocess.run([str(python), *INSTALL], cwd=source, env=clean_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    away = tmp_path / "elsewhere"  # outside the checkout and its copy: only what was installed is found
    away.mkdir()

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), cwd=away, env=clean_env(), capture_output=True, text=True, timeout=120)

    no_torch = run(str(python), "-c", "import torch")
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    listed = {p["name"].lower() for p in json.loads(run(str(python), "-m", "pip", "list", "--format", "json").stdout)}
    assert {"attention-client", "numpy", "grpcio", "protobuf", "grpcio-health-checking"} <= listed, listed
    assert not listed & {"torch", "matplotlib", "tokenizers", "prometheus-client"}, listed
    requires = run(str(python), "-c",
                   "import importlib.metadata as m; print('\\n'.join(m.requires('attention-client')))")
    plot = [line for line in requires.stdout.splitlines() if line.startswith("matplotlib")]
    assert plot and all('extra == "plot"' in line for line in plot), requires.stdout
    imported = run(str(python), "-c", "import client, proto.attention.v1.codec as c; print(c.__file__)")
    assert imported.returncode == 0 and str(venv) in imported.stdout, imported.stderr

    command = str(venv / "bin" / "attention-client")
    server = ServerProcess(tiny_text_bundle, "--log-level", "warning", directory=tmp_path / "server", timeout=60)
    try:
        info = run(command, "--target", server.target, "info")
        assert info.returncode == 0, info.stderr
        assert "tiny-bert" in info.stdout and "text.max_tokens" in info.stdout
        encoded = run(command, "--target", server.target, "encode", "--text", "the cat", "--no-hidden")
        assert encoded.returncode == 0, encoded.stderr
        assert "sequence 0: 4 tokens" in encoded.stdout and "pooled    [32]" in encoded.stdout
        plot = run(command, "--target", server.target, "plot", "--text", "the cat", "--out", str(away / "a.png"))
        assert plot.returncode == 2 and "client[plot]" in plot.stderr  # the extra was not asked for
        assert len(plot.stderr.strip().splitlines()) == 1, plot.stderr
    finally:
        server.stop()


def test_the_console_scripts_name_real_functions() -> None:
    service = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    client = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    assert service["scripts"]["attention-service"] == "service.__main__:main"
    assert service["scripts"]["attention-client"] == client["scripts"]["attention-client"] == "client.cli:main"
    for target in (*service["scripts"].values(), *client["scripts"].values()):
        module, _, name = target.partition(":")
        assert callable(getattr(import_module(module), name)), target
    deps = " ".join(client["dependencies"])
    assert "torch" not in deps and "matplotlib" not in deps and client["optional-dependencies"]["plot"]
    runtime = (ROOT / "requirements.txt").read_text()
    assert "matplotlib" not in runtime and "tqdm" not in runtime and "pytest" not in runtime
