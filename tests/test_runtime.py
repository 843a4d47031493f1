"""The process-wide settings the entry points fix for themselves (mtp/runtime.py), on the CPU: the
GPU decision, the XLA flags it sets or keeps, and the matmul precision."""

import pathlib
import subprocess
import sys

import pytest

from mtp import runtime

REPO = pathlib.Path(__file__).resolve().parents[1]
FLAGS = " ".join(runtime.GRAPH_UPDATE_FLAGS)


@pytest.mark.parametrize("environ, nodes, plugin, gpu", [
    ({}, ["/dev/nvidia0"], True, True),
    ({"JAX_PLATFORMS": "cuda"}, ["/dev/nvidia0"], True, True),
    ({"JAX_PLATFORMS": "cuda,cpu"}, ["/dev/nvidia0"], True, True),
    ({"JAX_PLATFORMS": "cpu"}, ["/dev/nvidia0"], True, False),  # the user kept JAX off the GPU
    ({"CUDA_VISIBLE_DEVICES": ""}, ["/dev/nvidia0"], True, False),  # every device hidden
    ({"CUDA_VISIBLE_DEVICES": "-1"}, ["/dev/nvidia0"], True, False),
    ({"CUDA_VISIBLE_DEVICES": "1"}, ["/dev/nvidia0", "/dev/nvidia1"], True, True),
    ({}, [], True, False),  # a CUDA jaxlib on a machine without a GPU
    ({}, ["/dev/nvidia0"], False, False),  # a GPU, but a CPU-only jaxlib
])
def test_a_gpu_is_detected_from_the_plugin_the_device_nodes_and_the_environment(environ, nodes, plugin, gpu):
    assert runtime.gpu_present(environ, device_nodes=nodes, plugin_importable=plugin) is gpu


def test_this_cpu_machine_has_no_gpu():
    """What the entry points see here: the CPU jaxlib has no CUDA plugin (and no device node)."""
    assert not runtime.gpu_present({})


def test_the_graph_update_flags_are_set_on_a_gpu_unless_the_user_set_xla_flags():
    on_gpu = runtime.decide_xla_flags({}, gpu=True)
    assert on_gpu.value == FLAGS and "set by the program" in on_gpu.reason and "CUDA graphs" in on_gpu.reason
    off_gpu = runtime.decide_xla_flags({}, gpu=False)
    assert off_gpu.value is None and "no GPU" in off_gpu.reason
    for users in ("--xla_gpu_autotune_level=0", ""):  # an empty value is the user's too: XLA's defaults
        kept = runtime.decide_xla_flags({"XLA_FLAGS": users}, gpu=True)
        assert kept.value is None and repr(users) in kept.reason and "as the user set it" in kept.reason


def test_configure_process_writes_the_decision_into_the_environment_it_is_given():
    environ = {}
    settings = runtime.configure_process(environ=environ, gpu=True)
    assert environ == {"XLA_FLAGS": FLAGS} and settings.xla_flags.value == FLAGS
    assert settings.as_dict()["xla_flags_set"] == FLAGS and settings.gpu
    users = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    settings = runtime.configure_process(environ=users, gpu=True)
    assert users == {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}  # kept as given
    assert settings.xla_flags.value is None and "--xla_force_host_platform_device_count=2" in settings.describe()


def test_f32_compute_runs_its_matmuls_at_full_precision():
    assert runtime.matmul_precision_for("float32") == "highest"
    assert runtime.matmul_precision_for("bfloat16") is None and runtime.matmul_precision_for(None) is None


# A fresh process: the flags must be in place before JAX starts its backend, and are refused after.
_FRESH = """
import os, jax, jax.numpy as jnp
from jax._src import xla_bridge
from mtp import runtime
assert not xla_bridge.backends_are_initialized()
settings = runtime.configure_process("float32", gpu=True)  # as on a GPU machine, before the backend starts
assert os.environ["XLA_FLAGS"] == {flags!r}, os.environ.get("XLA_FLAGS")
assert settings.matmul_precision == jax.config.jax_default_matmul_precision == "highest"
assert "'highest' precision" in settings.describe() and "set by the program" in settings.describe()
jnp.ones(2).block_until_ready()  # the backend starts with the flags (XLA parses them; the CPU ignores them)
del os.environ["XLA_FLAGS"]
try:
    runtime.configure_process(gpu=True)
    raise AssertionError("flags were set after the backend started")
except RuntimeError as e:
    assert "after JAX started its backend" in str(e)
print("checked")
"""


def test_the_flags_are_set_before_the_backend_starts_and_refused_after():
    proc = subprocess.run([sys.executable, "-c", _FRESH.format(flags=FLAGS)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
                                                       "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0 and "checked" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
