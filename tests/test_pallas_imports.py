"""Every `mtp.pallas` module imports on its own, first in a fresh process (a benchmark or a test
may import one kernel before `mtp.model`, which imports the kernels back)."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in (ROOT / "mtp" / "pallas").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_first(module):
    run = subprocess.run([sys.executable, "-c", f"import mtp.pallas.{module}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
