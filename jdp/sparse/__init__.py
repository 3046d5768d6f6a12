"""Sparse gradients for embedding tables (Caffe2's `GradientSlice` path).

A table's gradient is kept as the looked-up rows (`IndexedRows`), the replicas
all-gather them, and row-wise optimizers update only the touched rows; the
sync piece `rows()` all-reduces the rest of the model as usual.
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
    "AdagradRowState", "AdamRowState", "IdsOutOfRangeError", "IndexedRows",
    "MomentumRowState", "OptimizerState", "RowOptimizer", "SparseTransformation",
    "adagrad", "adam", "all_gather_rows", "combine_rows", "lookup", "momentum",
    "optimizer", "rows", "sgd", "value_and_grad",
]  # fmt: skip
