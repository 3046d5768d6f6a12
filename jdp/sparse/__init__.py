"""Sparse gradients for embedding tables (Caffe2's `GradientSlice` path).

A batch touches a few thousand rows of a table that may have millions, but a
dense gradient and its all-reduce cost the whole table every step. Here a
table's gradient is kept as the looked-up rows (`IndexedRows`), the replicas
exchange them with `all_gather_rows`, and row-wise optimizers update only the
touched rows: `sgd` and `adagrad` as `optax.sgd` / `optax.adagrad` would;
`momentum` and `adam` (lazy, as PyTorch's `SparseAdam`) leave the rows outside
the batch and their state alone, where dense momentum and Adam move them.
`rows()`, a sync piece, adds the usual dense path for the rest of the model:

    tx = jdp.sparse.optimizer(optax.adam(1e-3), {"embed": jdp.sparse.adagrad(0.1)})
    step = jdp.parallelize(jdp.make_train_step(loss_fn, tx, sync=jdp.sparse.rows()))

where `loss_fn` reads the table with `jdp.sparse.lookup(params["embed"], ids)`.
"""

from jdp.sparse._gather import all_gather_rows, combine_rows
from jdp.sparse._lookup import IndexedRows, lookup, value_and_grad
from jdp.sparse._optim import (
    AdagradRowState,
    AdamRowState,
    MomentumRowState,
    OptimizerState,
    RowOptimizer,
    SparseTransformation,
    adagrad,
    adam,
    momentum,
    optimizer,
    sgd,
)
from jdp.sparse._train_step import IdsOutOfRangeError, rows

__all__ = [
    "AdagradRowState",
    "AdamRowState",
    "IdsOutOfRangeError",
    "IndexedRows",
    "MomentumRowState",
    "OptimizerState",
    "RowOptimizer",
    "SparseTransformation",
    "adagrad",
    "adam",
    "all_gather_rows",
    "combine_rows",
    "lookup",
    "momentum",
    "optimizer",
    "rows",
    "sgd",
    "value_and_grad",
]
