"""How a step's metrics are combined over replicas.

Metrics a `jdp.parallelize` step returns are averaged over replicas. Wrap one in

- `jdp.metrics.sum(x)`: summed instead (counts stay exact integers);
- `jdp.metrics.gather(x)`: every replica's values, in global batch order
  (per-example predictions, say).
"""

from jdp._metrics import gather, sum

__all__ = ["gather", "sum"]
