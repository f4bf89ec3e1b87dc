"""Distributed TENGraD on ``torch.distributed``: the global batch's Fisher blocks, layers
solved on different ranks (:mod:`.optimizer`), the owner assignment (:mod:`.plan`), the
collectives (:mod:`.comm`) and the per-rank data shards (:mod:`.shard`).

Sits above :mod:`tengrad_fx.optim` (imports run one way)."""
from .comm import DistributedStepError
from .optimizer import DistributedTENGraD, mc_seed
from .plan import assign_owners, solve_cost
from .shard import shard_indices

__all__ = ["DistributedTENGraD", "DistributedStepError", "mc_seed", "assign_owners", "solve_cost",
           "shard_indices"]
