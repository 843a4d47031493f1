"""The kernel layer: self-contained ops of the model, each a package in tokamax's shape.

An op package imports only JAX, numpy and other modules of ``mtp.ops``, never the model, the
caches or the config: ``reference.py`` holds its pure-JAX definition, which is the model's own
math for what the kernel fuses (the model imports it from there), the kernel files
(``triton.py``, ``mosaic.py``: the Pallas lowering they use) implement the same signature, and
``api.py`` holds the public entry point, whose ``impl`` goes through the one switch
(`dispatch.choose`); the model hands each op the path its `mtp.execution.ExecutionConfig` names.
Shared beside them: `dispatch` (the switch),
`lowering` (the target device, meshes, compiler parameters, interpreter scopes), `norms` (the
model's norms) and `paged_kv` (the paged KV layout and its page writes).
"""
