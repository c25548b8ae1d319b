"""CUDA path of :func:`hybridkv.model.kda.kda_chunked` through flash-linear-attention.

Imported lazily; install with ``pip install flash-linear-attention`` (extra
``hybridkv[cuda]``). Conventions match :mod:`hybridkv.model.kda`: ``q`` already
scaled (we pass ``scale=1``), ``g`` the per-channel log-decay, no in-kernel L2
norm, states ``[.., H, K, V]`` float32.

Exactness: states at requested boundaries are the fp32 *final* states of
consecutive ``chunk_kda`` calls split at those boundaries (fla's
``return_intermediate_states`` hands back bf16 chunk-start states, which are
not exact enough for a checkpoint).
"""

from __future__ import annotations

import torch

_MODULE = None


def available() -> bool:
    """True when ``fla.ops.kda`` imports."""
    global _MODULE
    if _MODULE is None:
        try:
            import fla.ops.kda as mod  # type: ignore[import-not-found]
            _MODULE = mod
        except ImportError:
            _MODULE = False
    return _MODULE is not False


def _ops():
    if not available():
        raise ImportError("flash-linear-attention is not installed: pip install flash-linear-attention")
    return _MODULE


def _b(x: torch.Tensor, nd: int) -> torch.Tensor:
    return x.unsqueeze(0) if x.dim() == nd else x


def chunk_with_states(q, k, v, g, beta, initial_state, boundaries):
    """``(o, final_state, {b: state})`` as :func:`~hybridkv.model.kda.kda_chunked`, via fla.

    ``q, k, g: [.., T, H, K]``, ``v: [.., T, H, V]``, ``beta: [.., T, H]``; boundaries
    sorted local token counts in ``[1, T]``. Runs ``chunk_kda`` per segment
    (``fused_recurrent_kda`` for one-token segments).
    """
    ops = _ops()
    squeeze = q.dim() == 3
    q, k, v, g = (_b(x, 3) for x in (q, k, v, g))
    beta = _b(beta, 2)
    B, T, H, K = q.shape
    S = (torch.zeros(B, H, K, v.shape[-1], dtype=torch.float32, device=q.device)
         if initial_state is None else _b(initial_state, 3).float().clone())
    outs, states, start = [], {}, 0
    for end in sorted(set(boundaries) | {T}):
        sl = slice(start, end)
        args = {"q": q[:, sl].contiguous(), "k": k[:, sl].contiguous(), "v": v[:, sl].contiguous(),
                    "g": g[:, sl].float().contiguous(), "beta": beta[:, sl].contiguous(), "scale": 1.0,
                    "initial_state": S.clone(), "output_final_state": True, "use_qk_l2norm_in_kernel": False}
        fn = ops.fused_recurrent_kda if end - start == 1 else ops.chunk_kda
        o, S = fn(**args)[:2]
        S = S.float()
        outs.append(o.float())
        if end in boundaries:
            states[end] = S.clone()
        start = end
    o = torch.cat(outs, dim=1)
    if squeeze:
        return o[0], S[0], {b: s[0] for b, s in states.items()}
    return o, S, states


def recurrent(q, k, v, g, beta, initial_state):
    """``(o, final_state)`` as :func:`~hybridkv.model.kda.kda_recurrent`, via
    ``fused_recurrent_kda`` (the initial state is cloned: some fla versions update
    it in place)."""
    ops = _ops()
    squeeze = q.dim() == 3
    q, k, v, g = (_b(x, 3).contiguous() for x in (q, k, v, g))
    beta = _b(beta, 2).contiguous()
    B, _T, H, K = q.shape
    S = (torch.zeros(B, H, K, v.shape[-1], dtype=torch.float32, device=q.device)
         if initial_state is None else _b(initial_state, 3).float().clone())
    o, S = ops.fused_recurrent_kda(q=q, k=k, v=v, g=g.float(), beta=beta, scale=1.0, initial_state=S,
                                   output_final_state=True, use_qk_l2norm_in_kernel=False)[:2]
    o, S = o.float(), S.float()
    return (o[0], S[0]) if squeeze else (o, S)

