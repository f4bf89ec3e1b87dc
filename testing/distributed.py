"""Run a function on ``W`` gloo ranks (one process each, spawned) from a test: the
launcher of ``tools._spawn`` (also used by ``python -m tools.bench --distributed N``)."""
from tools._spawn import RanksFailed, free_port, run_ranks

__all__ = ["free_port", "run_ranks", "RanksFailed"]
