"""Array-level ops: one module per kernel family (validate, plan the launch, launch; NumPy reference)."""
