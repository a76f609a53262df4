"""Array-level ops: one module per kernel family (validate, plan the launch, launch; NumPy reference). Each module's
``__all__`` is its public API, re-exported as ``ck.<name>`` by ``cukernels/__init__.py``; this package keeps the
modules themselves as its attributes (``cukernels.ops.gemv`` is the module, ``ck.gemv`` the function)."""
