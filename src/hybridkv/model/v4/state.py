"""DeepSeek-V4 state at a boundary ``t`` (DESIGN §12), split the way a prefix cache keeps it.

* :class:`V4CompressedEntries` — **prefix-closed**: every compressed entry whose window
  closed at or before ``t`` (CSA: one per ``csa_rate`` tokens, with the Lightning Indexer's
  entry of the same window; HCA: one per ``hca_rate`` tokens). Entry ``k`` of a layer with
  rate ``m`` depends only on tokens before ``(k + 1)·m``, so entries page like KV, each group at
  its own granularity; :meth:`V4CompressedEntries.slice` cuts a page.
* :class:`V4BoundaryState` — **not prefix-closed**, fixed size, like a KDA checkpoint
  ``C(P_t)``: each layer's sliding window (the K=V rows of the last ``sliding_window − 1``
  tokens), each compressor's unfinished tail (raw ``kv``/``gate`` projections of the
  ``t mod m`` tokens since its last closed window) and, for CSA, the overlap slice (the ``Ca``
  half of the raw projections of the last closed window, which the next entry pools).

:class:`V4State` is the pair; :func:`restore` builds one from parts stored separately.
All tensors are in the model's compute dtype (float32 by default), on its device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _nb(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclass(slots=True)
class CompressorTail:
    """One compressor's boundary state at ``t`` (tokens since its last closed window).

    Attributes:
        kv, gate: ``[t mod m, width]`` raw projections (``width`` = ``2·head_dim`` for CSA,
            ``head_dim`` for HCA, ``2·index_head_dim`` for the indexer), oldest first; the
            position bias is not added.
        overlap_kv, overlap_gate: ``[m, width / 2]``: the ``Ca`` half of the raw projections of
            the last closed window (CSA and its indexer only; ``None`` for HCA or before the
            first window closes).
    """

    kv: torch.Tensor
    gate: torch.Tensor
    overlap_kv: torch.Tensor | None = None
    overlap_gate: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the tail and overlap tensors."""
        return _nb(self.kv) + _nb(self.gate) + _nb(self.overlap_kv) + _nb(self.overlap_gate)

    def clone(self) -> CompressorTail:
        """Deep copy (new storage)."""
        c = (lambda t: None if t is None else t.clone())
        return CompressorTail(self.kv.clone(), self.gate.clone(), c(self.overlap_kv), c(self.overlap_gate))


@dataclass(slots=True)
class LayerBoundary:
    """One layer's boundary state at ``t``.

    Attributes:
        window: ``[min(t, sliding_window − 1), head_dim]`` K=V rows (after norm and RoPE) of
            positions ``[t − len, t)``, oldest first.
        compressor: the CSA/HCA compressor's tail (``None`` on a sliding layer).
        indexer: the CSA Lightning Indexer's compressor tail (``None`` unless CSA).
    """

    window: torch.Tensor
    compressor: CompressorTail | None = None
    indexer: CompressorTail | None = None

    @property
    def window_nbytes(self) -> int:
        """Bytes of the sliding window."""
        return _nb(self.window)

    @property
    def tail_nbytes(self) -> int:
        """Bytes of the compressor tails and overlaps."""
        return sum(c.nbytes for c in (self.compressor, self.indexer) if c is not None)

    def clone(self) -> LayerBoundary:
        """Deep copy (new storage)."""
        return LayerBoundary(self.window.clone(), self.compressor and self.compressor.clone(),
                             self.indexer and self.indexer.clone())


@dataclass(slots=True)
class V4BoundaryState:
    """Every layer's boundary state at token ``boundary`` (a checkpoint, like ``C(P_t)``).

    Attributes:
        boundary: ``t`` in tokens.
        layers: one :class:`LayerBoundary` per layer, in model order.
    """

    boundary: int
    layers: list[LayerBoundary]

    @property
    def window_nbytes(self) -> int:
        """Bytes of all sliding windows."""
        return sum(lb.window_nbytes for lb in self.layers)

    @property
    def tail_nbytes(self) -> int:
        """Bytes of all compressor tails and CSA overlaps."""
        return sum(lb.tail_nbytes for lb in self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole boundary state."""
        return self.window_nbytes + self.tail_nbytes

    def clone(self) -> V4BoundaryState:
        """Deep copy (new storage)."""
        return V4BoundaryState(self.boundary, [lb.clone() for lb in self.layers])


@dataclass(slots=True)
class V4CompressedEntries:
    """Compressed entries of every closed window up to token ``boundary`` (prefix-closed).

    Attributes:
        boundary: ``t`` in tokens; a layer of rate ``m`` holds ``t // m`` entries.
        rates: per layer, tokens per entry (0 for a sliding layer).
        kv: per layer ``[t // m, head_dim]`` entries (after norm and RoPE at the window's first
            position), ``None`` for a sliding layer.
        index: per layer ``[t // m, index_head_dim]`` Lightning Indexer keys (CSA only; else ``None``).
    """

    boundary: int
    rates: tuple[int, ...]
    kv: list[torch.Tensor | None]
    index: list[torch.Tensor | None] = field(default_factory=list)

    def group_nbytes(self, kinds: tuple[str, ...]) -> dict[str, int]:
        """Bytes per group: ``{"csa": entries + indexer keys, "hca": entries}``; ``kinds`` is the
        config's ``layer_types``."""
        out = {"csa": 0, "hca": 0}
        for kind, kv, ix in zip(kinds, self.kv, self.index):
            if kind in out:
                out[kind] += _nb(kv) + _nb(ix)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of all entries."""
        return sum(_nb(t) for t in self.kv) + sum(_nb(t) for t in self.index)

    def _check(self, t: int) -> None:
        if not 0 <= t <= self.boundary:
            raise ValueError(f"token {t} outside the entries' range [0, {self.boundary}]")

    def upto(self, t: int) -> V4CompressedEntries:
        """The entries of windows closed at or before ``t`` (views, no copy).

        Raises:
            ValueError: ``t`` outside ``[0, boundary]``.
        """
        self._check(t)
        cut = (lambda x, m: None if x is None else x[: t // m])
        return V4CompressedEntries(t, self.rates, [cut(x, m) for x, m in zip(self.kv, self.rates)],
                                   [cut(x, m) for x, m in zip(self.index, self.rates)])

    def slice(self, t0: int, t1: int) -> V4CompressedEntries:
        """A page: per layer the entries whose window closes in ``(t0, t1]``, i.e. entries
        ``[t0 // m, t1 // m)`` (views). ``boundary`` of the result is ``t1``. Join pages with
        :meth:`concat` starting from 0.

        Raises:
            ValueError: ``t0 > t1`` or either outside ``[0, boundary]``.
        """
        self._check(t0)
        self._check(t1)
        if t0 > t1:
            raise ValueError(f"page start {t0} > end {t1}")
        cut = (lambda x, m: None if x is None else x[t0 // m: t1 // m])
        return V4CompressedEntries(t1, self.rates, [cut(x, m) for x, m in zip(self.kv, self.rates)],
                                   [cut(x, m) for x, m in zip(self.index, self.rates)])

    @staticmethod
    def concat(pages: list[V4CompressedEntries]) -> V4CompressedEntries:
        """Join consecutive pages ``slice(0, b1), slice(b1, b2), ...`` into the entries up to
        the last page's ``boundary`` (new storage).

        Raises:
            ValueError: no pages, or layers of different rates.
        """
        if not pages:
            raise ValueError("concat needs at least one page")
        rates = pages[0].rates
        if any(p.rates != rates for p in pages):
            raise ValueError("pages of different layer schedules")
        cat = (lambda xs: None if xs[0] is None else torch.cat(xs))
        n = len(rates)
        return V4CompressedEntries(pages[-1].boundary, rates,
                                   [cat([p.kv[i] for p in pages]) for i in range(n)],
                                   [cat([p.index[i] for p in pages]) for i in range(n)])

    def clone(self) -> V4CompressedEntries:
        """Deep copy (new storage)."""
        c = (lambda t: None if t is None else t.clone())
        return V4CompressedEntries(self.boundary, self.rates, [c(t) for t in self.kv], [c(t) for t in self.index])


@dataclass(slots=True)
class V4State:
    """The whole state of a sequence at token ``boundary``: compressed entries + boundary state."""

    compressed: V4CompressedEntries
    boundary_state: V4BoundaryState

    @property
    def boundary(self) -> int:
        """``t`` in tokens."""
        return self.boundary_state.boundary

    @property
    def nbytes(self) -> int:
        """Bytes of both parts."""
        return self.compressed.nbytes + self.boundary_state.nbytes

    def clone(self) -> V4State:
        """Deep copy (new storage)."""
        return V4State(self.compressed.clone(), self.boundary_state.clone())


def restore(compressed: V4CompressedEntries, boundary_state: V4BoundaryState) -> V4State:
    """The state at ``boundary_state.boundary`` from entries of at least that prefix
    (``compressed`` may reach further; it is cut to the boundary).

    Raises:
        ValueError: the entries end before the boundary, or belong to another schedule.
    """
    t = boundary_state.boundary
    if compressed.boundary < t:
        raise ValueError(f"compressed entries end at token {compressed.boundary}, before the boundary {t}")
    if len(compressed.kv) != len(boundary_state.layers):
        raise ValueError(f"compressed entries have {len(compressed.kv)} layers, the boundary state "
                         f"{len(boundary_state.layers)}")
    return V4State(compressed.upto(t), boundary_state)
