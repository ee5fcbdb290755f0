"""megarl benchmark suite: one module per benchmark, run by ``benchmarks/run.py``."""
