"""Run a function on ``W`` gloo ranks (one process each, spawned) from a test: the
launcher of :mod:`testing.spawn` (also used by ``python -m tools.bench --distributed N``)."""
from .spawn import RanksFailed, free_port, run_ranks

__all__ = ["free_port", "run_ranks", "RanksFailed"]
