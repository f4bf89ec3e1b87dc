"""Repository-only scripts (not installed): benchmarks, sweeps, coverage, the demo, run as
``python -m tools.X`` from the repository root. The installed programs live in
:mod:`tengrad_fx.cli`; ``tools.train`` / ``tools.reproduce`` run them from here."""
