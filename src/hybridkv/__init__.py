"""hybridkv: exact prefix cache for hybrid (MLA + KDA) LLMs.

``from hybridkv import LLM`` is the public entry point (:mod:`hybridkv.api`, README
"Python API"). ``LLM`` and ``GenerationOutput`` are loaded on first access, so importing
a lower layer (e.g. ``hybridkv.store.base``) does not import torch.
"""

__version__ = "0.1.0"

_LAZY = ("LLM", "GenerationOutput")


def __getattr__(name: str):
    if name == "LLM":
        from hybridkv.api import LLM
        return LLM
    if name == "GenerationOutput":
        from hybridkv.api import GenerationOutput
        return GenerationOutput
    raise AttributeError(f"module 'hybridkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
