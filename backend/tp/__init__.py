"""Tensor parallelism over ``torch.distributed``: shards of the hybrid model split by heads
(``backend.tp.shard``) whose partial outputs are summed across ranks (``backend.hybrid.model.Collective``)."""

from backend.hybrid.model import Collective
from backend.tp.shard import check_tp, fingerprint, shard_config, shard_model, shard_weights

__all__ = ["Collective", "check_tp", "fingerprint", "shard_config", "shard_model", "shard_weights"]
