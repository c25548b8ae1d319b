"""``torch``, imported on its first use.

A simulated replay keeps its cache as bookkeeping only and never computes with tensors, but
the modules it runs (engine, tiers, checkpoint pools) also serve the real model; importing
torch at their top cost a simulated run about 1 CPU second of start-up (docs/results/replay.md,
"Simulator speed"). Those modules take ``torch`` from here instead: an object
whose attributes are the torch module's, which imports torch when the first one is read and
keeps each attribute read, so later reads are ordinary attribute lookups.

Annotations (``from __future__ import annotations``) never read it; code run when a module
is imported (decorators, default arguments, module-level tables) must not either, or the
import comes back.
"""

from __future__ import annotations

import importlib


class _LazyTorch:
    """Attribute access to the ``torch`` module, importing it on the first read."""

    def __getattr__(self, name: str):
        value = getattr(importlib.import_module("torch"), name)
        setattr(self, name, value)          # read once: later reads do not come here
        return value

    def __repr__(self) -> str:
        return "<torch, imported on first use>"


torch = _LazyTorch()
