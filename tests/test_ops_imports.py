"""The kernel layer stands alone: each op package imports first in a fresh process and pulls in none
of the model, the caches, the config or the engine (`mtp.ops` imports only JAX and itself).

One process per op package (each imports all of its modules, then the shared ones beside the
packages), as a benchmark or a test may import one op before anything else; the modules it loads
must come from this checkout.
"""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPS = ROOT / "mtp" / "ops"
PACKAGES = sorted(p.name for p in OPS.iterdir() if (p / "__init__.py").exists())
SHARED = sorted(f"mtp.ops.{p.stem}" for p in OPS.glob("*.py") if p.stem != "__init__")
FORBIDDEN = ("mtp.model", "mtp.cache", "mtp.config", "mtp.serving")

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
mtp = {m: getattr(v, "__file__", None) for m, v in sys.modules.items() if m == "mtp" or m.startswith("mtp.")}
print(json.dumps(mtp))
"""


def _modules(package: str) -> list[str]:
    return [f"mtp.ops.{package}.{p.stem}" if p.stem != "__init__" else f"mtp.ops.{package}"
            for p in sorted((OPS / package).glob("*.py"))]


@pytest.mark.parametrize("package", PACKAGES)
def test_op_imports_alone_and_never_the_model(package):
    run = subprocess.run([sys.executable, "-c", PROBE, *_modules(package), *SHARED], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    loaded = json.loads(run.stdout.splitlines()[-1])
    assert not [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)], sorted(loaded)
    outside = {m: f for m, f in loaded.items() if f and not pathlib.Path(f).resolve().is_relative_to(ROOT)}
    assert not outside, outside


def test_every_op_package_is_probed():
    assert {"add_rms_norm", "attn_prologue", "conv_step", "fc_gemm", "fp8", "gdn_step", "moe",
            "paged_attention"} <= set(PACKAGES)
