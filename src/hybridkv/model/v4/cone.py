"""The recompute cone of DeepSeek-V4's boundary state (torch-free: the simulator prices it too).

Re-exported by :mod:`hybridkv.model.v4.model`; derivation in docs/concepts/v4.md.
"""

from __future__ import annotations

from hybridkv.model.v4.config import V4Config


def recompute_cone_rows(config: V4Config, h: int) -> tuple[int, ...]:
    """Rows each layer's *input* must be recomputed for, to rebuild the boundary state at ``h``
    from the compressed entries of ``[0, h)`` and the raw tokens.

    Layer ``l``'s boundary state needs its inputs at the last ``N_l(h)`` positions:
    ``N_l = sliding_window − 1`` (the window), and on a compressed layer of rate ``m`` also
    ``h mod m`` (the unfinished tail) plus, on CSA once a window has closed, ``m`` (the overlap
    slice, the ``Ca`` half of the last closed window). Computing layer ``l``'s *outputs* at the
    last ``R_{l+1}`` positions needs its inputs ``sliding_window − 1`` positions further back
    (compressed entries are loaded, and MoE/mHC are token-wise), so

        ``R_L = 0``,  ``R_l = min(h, max(N_l, R_{l+1} + sliding_window − 1))`` (``R_{l+1} > 0``).

    Returns:
        ``(R_0, ..., R_{L-1})`` in tokens; ``R_0`` is :func:`recompute_cone_tokens`.

    Raises:
        ValueError: ``h < 0``.
    """
    if h < 0:
        raise ValueError(f"boundary h={h} must be >= 0")
    w1 = config.sliding_window - 1
    rows = [0] * (config.num_hidden_layers + 1)
    for li in reversed(range(config.num_hidden_layers)):
        m = config.rate(li)
        need = w1
        if m:
            need = max(need, h % m + (m if config.layer_types[li] == "csa" and h >= m else 0))
        below = rows[li + 1] + w1 if rows[li + 1] else 0
        rows[li] = min(h, max(need, below))
    return tuple(rows[:-1])


def recompute_cone_tokens(config: V4Config, h: int) -> int:
    """Exact number of prefix tokens to recompute to rebuild the V4 boundary state at ``h``
    when no boundary state is stored (the seed's third SWA strategy).

    With ``W = sliding_window`` and ``L`` layers the recursion of :func:`recompute_cone_rows`
    unrolls to ``min(h, max_l (N_l(h) + l·(W − 1)))`` (0-based ``l``). When every
    ``N_l = W − 1`` — true for V4's shapes at 64-aligned ``h``: CSA needs ``h mod 4 + 4 ≤ W − 1``,
    HCA ``h mod 128 ∈ {0, 64} ≤ W − 1`` — this is ``L·(W − 1)``, a little under the seed's
    worst-case bound ``n_win·L`` (DeepSeek-V4 report): for V4-Flash (43 layers, ``W = 128``)
    5461 tokens against 5504. Only the last layers' state needs the whole cone; layer ``l``
    computes outputs for ``R_{l+1}`` positions (:func:`recompute_cone_rows`).

    Raises:
        ValueError: ``h < 0``.
    """
    rows = recompute_cone_rows(config, h)
    return rows[0] if rows else 0
