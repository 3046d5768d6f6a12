"""Private: the checks of a state a step receives and returns (layout, types)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jdp._layout._custom import is_custom
from jdp._layout._mesh import AxisName
from jdp._tree import PyTree, format_problems, keystr

NOT_REPLICATED_MSG = (
    "`step`: the state passed in was not replicated by this step's `step.replicate` "
    "(or was replicated for another backend or device set). Expected every array "
    "leaf to hold one copy per replica: a leading axis of size num_replicas={num} "
    "sharded over mesh axis {axis!r} of this step's devices. Offending leaves:{probs}\n"
    "Fix: `state = step.replicate(state)` before the first call (to move a state "
    "from another `Parallel`, use `step.replicate(other.unreplicate(state))`)."
)

DONATED_MSG = (
    "`{api}`: the {what} passed in was donated to an earlier step, which deleted "
    "its buffers (`donate_state=True`). Deleted leaves:{probs}\nFix: continue "
    "with the state that step returned (`state, metrics = step(state, batch)`), "
    "or pass `donate_state=False` to `jdp.parallelize` to keep the old one."
)

STATE_CHANGED_MSG = (
    "`step`: the step returned a state whose structure, shapes or dtypes differ "
    "from the state it received (shapes per replica):{probs}\nEvery later call "
    "would compile again and train in the new types. Fix: return the state as it "
    "came in, e.g. cast updated leaves back (`new.astype(old.dtype)`); to change "
    "the state on purpose, do it outside the step and `step.replicate` it."
)


def describe(x: Any) -> str:
    """A leaf's shape and placement, for error messages."""
    if isinstance(x, jax.Array) and x.is_deleted():
        return f"shape {x.shape}, deleted (its buffers were donated to a step)"
    if isinstance(x, jax.Array):
        return f"shape {x.shape} with sharding {x.sharding}"
    return f"a {type(x).__name__} of shape {np.shape(x)} (not a placed jax.Array)"


def misplaced(
    tree: PyTree, sharding: NamedSharding, *, leading: int | None
) -> list[str]:
    """Leaves that are not live arrays sharded by `sharding` (with `leading` rows)."""

    def placed(x):
        return (
            isinstance(x, jax.Array)
            and not x.is_deleted()
            and x.ndim >= 1
            and (leading is None or x.shape[0] == leading)
            and (
                x.sharding == sharding or x.sharding.is_equivalent_to(sharding, x.ndim)
            )
        )

    if all(map(placed, jax.tree.leaves(tree))):  # the per-call fast path
        return []
    return [
        f"{keystr(path)}: {describe(x)}"
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        if not placed(x)
    ]


def check_replicated(
    state: PyTree, sharding: NamedSharding, *, axis_name: AxisName
) -> None:
    """Refuses a state not laid out by `replicate` for `sharding` (or deleted)."""
    num = sharding.mesh.size
    if not (probs := misplaced(state, sharding, leading=num)):
        return
    if gone := deleted(state):
        raise ValueError(
            DONATED_MSG.format(api="step", what="state", probs=format_problems(gone))
        )
    raise ValueError(
        NOT_REPLICATED_MSG.format(num=num, axis=axis_name, probs=format_problems(probs))
    )


def check_unchanged(before: PyTree, after: PyTree) -> None:
    """The state a step returns must be laid out as the one it received."""
    if probs := changes(before, after):
        message = STATE_CHANGED_MSG.format(probs=format_problems(probs))
        raise TypeError(message + _low_precision_hint(probs))


def _low_precision_hint(probs: list[str]) -> str:
    """Why an optimizer state of float16 (bfloat16) params comes back float32."""
    widened = [  # float16 or bfloat16
        p for p in probs if "opt_state" in p and "float16[" in p and "-> float32" in p
    ]
    if not widened:
        return ""
    hint = (
        "\nThe optimizer state of low-precision params came back in float32: optax "
        "keeps moments computed from float32 values (a float32 loss, a loss scaler) "
        "in float32. Keep the params in float32 and cast them to float16 inside the "
        "loss (float32 master weights, as flax's examples and loss scalers expect)."
    )
    if all(".mu" in p for p in widened):
        hint += (
            " Or keep Adam's first moment (`mu`) in the params' dtype: `optax.adam("
            "learning_rate, mu_dtype=jnp.float16)` (`optax.adamw` too)."
        )
    return hint


def check_not_deleted(tree: PyTree, api: str) -> None:
    """Refuses a pytree with donated (deleted) array leaves, naming them."""
    leaves = jax.tree.leaves(tree)
    if not any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
        return
    if gone := deleted(tree):
        raise ValueError(
            DONATED_MSG.format(api=api, what="pytree", probs=format_problems(gone))
        )


NOT_A_REPLICATED_TREE_MSG = (
    "`step.unreplicate` takes a pytree the step replicated (every array with a "
    "leading replica axis, split over the devices), e.g. the state it returned; "
    "these leaves are not (whole arrays, already unreplicated? or a batch split "
    "by `step.shard`, whose values are the batch itself):{probs}\nFix: use them "
    "as they are, or replicate them first with `step.replicate(tree)`."
)


def check_unreplicable(tree: PyTree) -> None:
    """Refuses array leaves that hold no replica axis to take one copy from."""
    if probs := whole_arrays(tree):
        raise ValueError(NOT_A_REPLICATED_TREE_MSG.format(probs=format_problems(probs)))


def whole_arrays(tree: PyTree) -> list[str]:
    """`"path: shape ..."` of the array leaves that hold no replica axis.

    Such a leaf's first shard holds more than one copy (the whole array, or a
    batch's examples); one of leading size 1 cannot be told from a one-device
    mesh's and is let through.
    """

    def whole(x):
        if not isinstance(x, jax.Array) or x.ndim == 0 or x.shape[0] == 1:
            return False
        # A replica's shard holds one copy: a leading axis of 1. (A batch split by
        # `step.shard` holds several examples.)
        return x.addressable_shards[0].data.shape[0] != 1

    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_custom)[0]
    return [f"{keystr(path)}: shape {x.shape}" for path, x in leaves if whole(x)]


def deleted(tree: PyTree) -> list[str]:
    """Paths of the array leaves of `tree` whose buffers are deleted (donated)."""
    return [
        keystr(path)
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        if isinstance(x, jax.Array) and x.is_deleted()
    ]


def check_same_structure(before: PyTree, after: PyTree) -> None:
    """The state a step returns must have the structure of the one it received.

    `before` may be that state's `PyTreeDef`. Checked while tracing the step.
    """
    if probs := _structure_change(before, after):
        raise TypeError(STATE_CHANGED_MSG.format(probs=format_problems(probs)))


def _structure_change(before: PyTree, after: PyTree) -> list[str]:
    old = before
    if not isinstance(before, jax.tree_util.PyTreeDef):
        old = jax.tree.structure(before)
    new = jax.tree.structure(after)
    if old == new:
        return []
    return [
        _first_change(old, new, "state") or f"the structure changed from {old} to {new}"
    ]


def _child_names(treedef) -> list[str]:
    """Names of a node's children: a flax NNX object's attribute names, else indices."""
    data = treedef.node_data()
    aux = None if data is None else data[1]
    names = aux[0] if isinstance(aux, tuple) and aux else None
    if isinstance(names, tuple) and len(names) == len(treedef.children()):
        return [str(n) for n in names]
    return [f"[{i}]" for i in range(len(treedef.children()))]


def _first_change(old, new, path: str) -> str | None:
    """Where two pytree structures first differ, in words (None if not found).

    A changed static attribute of a flax NNX object is named with both values.
    """
    od, nd = old.node_data(), new.node_data()
    if od is None or nd is None or od[0] is not nd[0]:
        return None
    if len(old.children()) != len(new.children()) or od[1] != nd[1]:
        static = _static_attributes(od[1]), _static_attributes(nd[1])
        if changed := [
            f"`{path}.{k}`: {static[0][k]!r} -> {static[1].get(k)!r}"
            for k in static[0]
            if static[0][k] != static[1].get(k)
        ]:
            return (
                f"a Python attribute of a {od[0].__name__} changed in the step, "
                f"{', '.join(changed)} (jdp returns the arrays a step computes, not "
                "its Python attributes; set them outside the step, e.g. "
                "`model.eval()` before the evaluation step is built, or keep a "
                "counter in an `nnx.Variable`)"
            )
        return None
    names = _child_names(old)
    for name, a, b in zip(names, old.children(), new.children(), strict=True):
        if a != b:
            return _first_change(a, b, f"{path}.{name}")
    return None


def _static_attributes(aux: Any) -> dict[str, Any]:
    """A flax NNX object's static attributes by name (empty for other nodes)."""
    if not (isinstance(aux, tuple) and len(aux) == 3):
        return {}
    names, values = aux[1], aux[2]
    pairs = isinstance(names, tuple) and isinstance(values, tuple)
    if not pairs or len(names) != len(values):
        return {}
    return {
        str(n): v
        for n, v in zip(names, values, strict=True)
        if not str(n).startswith("_pytree__")
    }


def changes(before: PyTree, after: PyTree) -> list[str]:
    """How replicated `after` differs from `before` in structure, shapes or dtypes."""
    if structure := _structure_change(before, after):
        return structure

    def kind(x):
        return f"{jnp.dtype(x.dtype).name}{list(x.shape[1:])}"

    olds = jax.tree_util.tree_flatten_with_path(before)[0]
    return [
        f"{keystr(path)}: {kind(a)} -> {kind(b)}"
        for (path, a), b in zip(olds, jax.tree.leaves(after), strict=True)
        if hasattr(a, "shape")
        and hasattr(b, "shape")
        and (tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype)
    ]
