"""hybridkv: exact prefix cache for hybrid (MLA + KDA) LLMs.

``from hybridkv import LLM`` is the public entry point (:mod:`hybridkv.api`, README
"Python API"). ``LLM`` and ``GenerationOutput`` are loaded on first access, so importing
a lower layer (e.g. ``hybridkv.store.base``) does not import torch.
"""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _dist_version

try:
    __version__: str = _dist_version("hybridkv")
    """The installed distribution's version (pyproject.toml ``[project] version``), e.g. ``"0.2.0"``."""
except _PackageNotFoundError:       # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

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
