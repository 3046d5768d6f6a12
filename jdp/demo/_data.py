"""Private: scikit-learn's bundled 8x8 digits, split and batched reproducibly."""

from __future__ import annotations

import dataclasses

import numpy as np

#: Share of the 1,797 images held out for testing.
TEST_FRACTION = 0.2
NUM_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class Digits:
    """Train and test arrays: images `(N, 8, 8, 1)` in [0, 1], labels `(N,)` int32."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits(*, split_seed: int = 0) -> Digits:
    """scikit-learn's digits, split (stratified) independently of the training seed."""
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    data = sk_load_digits()
    x = (data.images / 16.0).astype(np.float32)[..., None]
    y = data.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=TEST_FRACTION, random_state=split_seed, stratify=y
    )
    return Digits(x_train, y_train, x_test, y_test)


def train_batch(data: Digits, *, step: int, batch_size: int, seed: int) -> dict:
    """The global batch of training step `step` (0-based).

    Step `s` reads examples `s * batch_size ...` of the concatenated epochs,
    each a permutation drawn from `(seed, epoch)`: a resumed run sees exactly
    the batches of the uninterrupted run.
    """
    n = len(data.x_train)
    start = step * batch_size
    idx = []
    while len(idx) < batch_size:
        epoch, offset = divmod(start + len(idx), n)
        perm = np.random.default_rng((seed, epoch)).permutation(n)
        idx.extend(perm[offset : offset + batch_size - len(idx)].tolist())
    idx = np.asarray(idx)
    return {"x": data.x_train[idx], "y": data.y_train[idx]}
