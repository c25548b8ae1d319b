"""Reading and writing Kimi-Linear safetensors checkpoints under the published names.

Accepts a single ``model.safetensors`` or a sharded checkpoint described by
``model.safetensors.index.json``. The dense first-layer MLP may be stored as
``mlp.*`` (published) or ``block_sparse_moe.*`` (written by transformers); both
load. Saving always uses ``block_sparse_moe.*``, as transformers does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def canonical_name(name: str) -> str:
    """Map an accepted alias to the name this package uses (``.mlp.`` -> ``.block_sparse_moe.``)."""
    return name.replace(".mlp.", ".block_sparse_moe.")


def _files(directory: Path) -> dict[str, list[str]]:
    """safetensors file -> tensor names it should hold."""
    if (directory / INDEX).exists():
        weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
        return files
    if (directory / SINGLE).exists():
        return {SINGLE: []}
    raise FileNotFoundError(f"no {SINGLE} or {INDEX} in {directory}")


def read_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory under canonical names (CPU, stored dtype).

    Raises:
        FileNotFoundError: no checkpoint file, or a shard named in the index is missing.
        ValueError: a tensor named twice (e.g. under both ``mlp.`` and ``block_sparse_moe.``),
            an index entry whose shard lacks the tensor, or a file safetensors cannot read
            (truncated, garbled), naming the file.
    """
    directory = Path(directory)
    out: dict[str, torch.Tensor] = {}
    for fname, expected in _files(directory).items():
        path = directory / fname
        if not path.exists():
            raise FileNotFoundError(f"checkpoint shard {fname} (named in {INDEX}) is missing")
        try:
            _read_file(path, expected, out)
        except SafetensorError as exc:           # truncated, garbled or not a safetensors file
            raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None
    return out


def _read_file(path: Path, expected: list[str], out: dict[str, torch.Tensor]) -> None:
    """Add every tensor of one safetensors file to ``out`` under its canonical name."""
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        for name in expected:
            if name not in keys:
                raise ValueError(f"tensor {name!r} is listed in {INDEX} but not in {path.name}")
        for name in sorted(keys):
            canon = canonical_name(name)
            if canon in out:
                raise ValueError(f"tensor {name!r} is stored twice (as {canon!r})")
            out[canon] = f.get_tensor(name)


def load_into(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into ``module``'s state (casting to each parameter's dtype).

    Raises:
        ValueError: a missing, unexpected or misshaped tensor (the message names it).
    """
    state = module.state_dict()
    missing = sorted(set(state) - set(tensors))
    extra = sorted(set(tensors) - set(state))
    if missing:
        raise ValueError(f"checkpoint is missing tensor {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if extra:
        raise ValueError(f"checkpoint has unexpected tensor {extra[0]!r}"
                         + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    for name, target in state.items():
        src = tensors[name]
        if tuple(src.shape) != tuple(target.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(src.shape)}, "
                             f"expected {tuple(target.shape)}")
    with torch.no_grad():
        for name, target in state.items():
            target.copy_(tensors[name].to(device=target.device, dtype=target.dtype))


def write_tensors(directory: str | Path, tensors: dict[str, torch.Tensor],
                  max_shard_bytes: int | None = None) -> None:
    """Write ``tensors`` as ``model.safetensors`` or, when larger than ``max_shard_bytes``,
    as ``model-XXXXX-of-YYYYY.safetensors`` shards plus ``model.safetensors.index.json``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    items = [(k, v.detach().contiguous().cpu()) for k, v in sorted(tensors.items())]
    total = sum(v.numel() * v.element_size() for _, v in items)
    meta = {"format": "pt"}
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(dict(items), str(directory / SINGLE), metadata=meta)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in items:
        nb = v.numel() * v.element_size()
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nb
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata=meta)
        weight_map.update({k: fname for k in shard})
    (directory / INDEX).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
