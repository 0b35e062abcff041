"""Kernels for what decode spends its time on. Every kernel is a folder: `reference.py` (plain jnp, the numerical
ground truth and the fallback), one file per backend, `api.py` that dispatches, `README.md` with the math and the
byte/FLOP floor. `fnx.pallas.dispatch` picks the backend; model code calls only the `api` functions."""
