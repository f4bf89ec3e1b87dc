"""Command-line tools: demo, training, benchmarks, plots, sweeps (built on tengrad_fx and zoo)."""
