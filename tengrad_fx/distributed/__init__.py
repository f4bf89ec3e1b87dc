"""Distributed TENGraD on ``torch.distributed``: the global batch's Fisher blocks, layers
solved on different ranks (:mod:`.optimizer`; the records moved by :mod:`.records`, the
per-step products of ``gram-blocks`` layers in :mod:`.gram_blocks`), the owner assignment
and the cost models (:mod:`.plan`), the bytes each collective sends (:mod:`.traffic`), the
collectives (:mod:`.comm`), the per-rank data shards (:mod:`.shard`) and a rank's exit
(:mod:`.process_exit`); FSDP2-sharded
models in :mod:`.fsdp` (:class:`FSDPTENGraD`).

Sits above :mod:`tengrad_fx.optim` (imports run one way)."""
from .comm import DistributedStepError
from .fsdp import FSDPShards
from .fsdp_optimizer import FSDPTENGraD
from .optimizer import DistributedTENGraD, GlobalBatch
from .process_exit import exit_without_teardown
from .plan import assign_owners, choose_modes, choose_placement, solve_cost
from .shard import shard_indices

__all__ = ["DistributedTENGraD", "GlobalBatch", "FSDPShards", "FSDPTENGraD", "DistributedStepError",
           "assign_owners", "choose_modes", "choose_placement", "solve_cost", "shard_indices", "exit_without_teardown"]
