"""OpenMP's spin (service/__main__.py `openmp_defaults`): `python -m service` caps how long libgomp's threads spin
after a parallel region, unless the operator chose a spin or a wait policy; libgomp reads it when torch loads it,
so it must be set before anything imports torch. Read back from libgomp itself (OMP_DISPLAY_ENV=VERBOSE prints
the settings it runs with)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from service.__main__ import OPENMP_SPINCOUNT, openmp_defaults
from tests.support.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("env", "spin"), [
    ({}, OPENMP_SPINCOUNT),
    ({"GOMP_SPINCOUNT": "300000"}, "300000"),  # the operator's own
    ({"OMP_WAIT_POLICY": "ACTIVE"}, None),  # the policy decides the spin: ours would override it
    ({"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "2"}, None),
])
def test_the_spin_is_capped_unless_the_operator_chose_one(env: dict[str, str], spin: str | None) -> None:
    openmp_defaults(env)
    assert env.get("GOMP_SPINCOUNT") == spin


def test_nothing_python_m_service_imports_before_main_loads_torch() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, service.__main__; print('torch' in sys.modules)"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _libgomp_spin(log: str) -> str:
    found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", log)
    assert found, f"libgomp printed no settings:\n{log[-2000:]}"
    return found.group(1)


def test_the_served_process_runs_libgomp_with_the_capped_spin_and_leaves_an_operators_policy_alone(
        tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    spins = []
    for env in ({}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        server = ServerProcess(tiny_bundle, "--log-level", "warning", env={"OMP_DISPLAY_ENV": "VERBOSE", **env})
        try:
            spins.append(_libgomp_spin(server.output()))
        finally:
            server.stop()
    assert spins[0] == OPENMP_SPINCOUNT
    assert int(spins[1]) > int(OPENMP_SPINCOUNT)  # ACTIVE: libgomp's own (30 billion)
