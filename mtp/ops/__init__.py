"""Self-contained ops of the model, each a package in tokamax's shape.

An op package imports only JAX and numpy, never the model or the caches: ``api.py`` holds
the public entry point with its ``impl`` switch (`mtp.pallas.backend`), ``reference.py``
its pure-JAX reference, and kernel files beside them implement the same signature.
"""
