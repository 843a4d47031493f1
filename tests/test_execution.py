"""`mtp.execution.ExecutionConfig`: what each op is handed, the environment's one parser, and a
config as a jit static (two configs, two programs, no ``jax.clear_caches``)."""

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

from mtp import execution as execution_mod
from mtp.execution import ExecutionConfig
from mtp.model import target
from tests.conftest import paged_cache, random_params, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_impl_for_reads_the_op_then_the_global_entry():
    assert ExecutionConfig().impl_for("gdn_step") == "auto"
    both = ExecutionConfig.from_environ({"MTP_KERNELS": "interpret,gdn_step=reference"})
    assert both.impl_for("gdn_step") == "reference" and both.impl_for("fc_gemm") == "interpret"
    assert ExecutionConfig.everywhere("pallas") == ExecutionConfig.from_environ({"MTP_KERNELS": "pallas"})
    # An opt-in op reads only its own entry: a global value flips every other op.
    assert ExecutionConfig.everywhere("pallas").impl_for("paged_attention_triton") == "auto"
    named = ExecutionConfig.everywhere("pallas").with_kernels(paged_attention_triton="interpret")
    assert named.impl_for("paged_attention_triton") == "interpret" and named.impl_for("moe") == "pallas"
    assert named.with_kernels(paged_attention_triton="reference").kernels == (
        ("", "pallas"), ("paged_attention_triton", "reference"))  # an op's entry is replaced, not repeated
    assert hash(named) == hash(ExecutionConfig.everywhere("pallas").with_kernels(paged_attention_triton="interpret"))


@pytest.mark.parametrize("var,value,named", [
    ("MTP_KERNELS", "fast", "'fast'"), ("MTP_KERNELS", "gdn-step=pallas", "no op named 'gdn-step'"),
    ("MTP_KERNELS", "gdn_step=fast", "'fast'"), ("MTP_PAD_SMALL_GEMMS", "yes", "'yes'"),
    ("MTP_MERGE_PROJECTIONS", "on", "'on'"), ("MTP_SMALL_GEMMS_AS_REDUCE", "true", "'true'"),
    ("MTP_DECODE_LOOP_GRAPH", "on", "'on'")])
def test_a_bad_value_fails_in_one_line_naming_the_variable(var, value, named):
    with pytest.raises(ValueError) as err:
        ExecutionConfig.from_environ({var: value})
    message = str(err.value)
    assert "\n" not in message and var in message and named in message, message


def test_a_bad_field_is_named():
    with pytest.raises(ValueError, match=r"ExecutionConfig.kernels\['fc_gemm'\]='fast'"):
        ExecutionConfig(kernels=(("fc_gemm", "fast"),))
    with pytest.raises(ValueError, match="ExecutionConfig.loop_graph='on'"):
        ExecutionConfig(loop_graph="on")
    with pytest.raises(ValueError, match="ExecutionConfig.pad_rows=-1"):
        ExecutionConfig(pad_rows=-1)


def test_two_configs_compile_two_programs_without_clearing_caches():
    """The config is a static of the jitted model: a GEMM-layout switch changes the lowered program
    and a kernel choice the traced one, each in the same process, one right after the other."""
    cfg = tiny_config("tiny_dense")
    params = random_params(cfg, seed=1)
    cache = paged_cache(cfg, 1, blocks=4)
    tokens = jnp.ones((1, 1), jnp.int32)
    hlo = lambda e: target.decode.lower(cfg, params, cache, tokens, execution=e).as_text()
    plain, padded = ExecutionConfig(pad_small_gemms=False), ExecutionConfig(pad_small_gemms=True, pad_min_weight=0)
    assert hlo(plain) != hlo(padded)
    assert hlo(plain) == hlo(ExecutionConfig(pad_small_gemms=False))  # an equal config: the same program
    jaxpr = lambda e: str(jax.make_jaxpr(lambda c, t: target.decode(cfg, params, c, t, execution=e))(cache, tokens))
    assert "pallas_call" not in jaxpr(ExecutionConfig.everywhere("reference"))
    assert "pallas_call" in jaxpr(ExecutionConfig.everywhere("reference").with_kernels(gdn_step="interpret"))


def test_only_the_config_module_parses_the_switches():
    """No module of ``mtp`` reads an ``MTP_*`` variable: the entry points hand their parsed config on."""
    readers = [p.relative_to(ROOT).as_posix() for p in (ROOT / "mtp").rglob("*.py")
               if re.search(r"\benviron\b", p.read_text()) and p.name not in ("execution.py", "runtime.py")]
    assert readers == []
    assert "os" not in vars(execution_mod)  # the parser takes the mapping it is given
