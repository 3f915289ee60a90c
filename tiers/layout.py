"""How a stored weight reads as a matrix Wt [N, K]: one row per output channel.

Every quantizer works on Wt, the layout all GPTQ-family code uses; the
stored tensor is mapped to it by a permutation of its axes (output-channel
axis first) and back. `graph_ops.layout` reads the permutation off the graph;
this module only does the array arithmetic, so tiers never import graph_ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Layout:
    """A stored weight's shape and where its output channels are."""

    shape: tuple[int, ...]
    perm: tuple[int, ...] | None = None
    """Stored axes in Wt order, output-channel axis first; None: unknown (one row, per-tensor scale)."""
    row_groups: int = 1
    """Conv groups: Wt's rows split into this many blocks, each reading its own inputs."""

    def __post_init__(self):
        if self.perm is not None and sorted(self.perm) != list(range(len(self.shape))):
            raise ValueError(f"perm {self.perm} does not permute the axes of shape {self.shape}")

    @classmethod
    def channels_on(cls, shape: tuple[int, ...], axis: int | None) -> "Layout":
        """Output channels on `axis`, the remaining axes flattened in order."""
        if axis is None or len(shape) == 0:
            return cls(tuple(shape))
        axis %= len(shape)
        return cls(tuple(shape), (axis,) + tuple(i for i in range(len(shape)) if i != axis))

    @property
    def channel_axis(self) -> int | None:
        return None if self.perm is None else self.perm[0]

    @property
    def params(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def wt_shape(self) -> tuple[int, int]:
        rows = 1 if self.perm is None else self.shape[self.perm[0]]
        return rows, self.params // max(rows, 1)

    @property
    def channels(self) -> int:
        return self.wt_shape[0]

    @property
    def block_axis(self) -> int | None:
        """The stored reduction axis DequantizeLinear blocks run along (rank-2 weights only)."""
        if len(self.shape) == 2 and self.perm is not None:
            return self.perm[1]
        return None

    def effective_group(self, group_size: int | None) -> int | None:
        """The block size this weight can use: blockwise needs a rank-2 weight with known layout."""
        return group_size if group_size and self.block_axis is not None else None

    def scale_shape(self, group_size: int | None) -> tuple[int, ...]:
        """Shape of the scale array DequantizeLinear takes for this layout."""
        if self.perm is None:
            return ()
        group = self.effective_group(group_size)
        if group:
            shape = list(self.shape)
            shape[self.block_axis] = math.ceil(shape[self.block_axis] / group)
            return tuple(shape)
        return (self.shape[self.perm[0]],)

    def to_wt(self, stored: np.ndarray) -> np.ndarray:
        """The stored tensor as Wt [N, K]."""
        moved = stored if self.perm is None else np.transpose(stored, self.perm)
        return np.reshape(moved, self.wt_shape)

    def from_wt(self, wt: np.ndarray) -> np.ndarray:
        """Wt [N, K] back in the stored layout."""
        if self.perm is None:
            return np.reshape(wt, self.shape)
        moved = np.reshape(wt, tuple(self.shape[a] for a in self.perm))
        return np.transpose(moved, np.argsort(self.perm))

    def rows(self, start: int, stop: int) -> "Layout":
        """The layout of output channels start..stop (a channel group of this weight)."""
        if self.perm is None:
            raise ValueError("a weight with unknown layout cannot be split by output channel")
        shape = list(self.shape)
        shape[self.perm[0]] = stop - start
        return Layout(tuple(shape), self.perm, 1)

    def take_rows(self, stored: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Output channels start..stop of the stored array."""
        return np.take(stored, np.arange(start, stop), axis=self.perm[0])
