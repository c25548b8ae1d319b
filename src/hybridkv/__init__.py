"""hybridkv: exact prefix cache for hybrid (MLA + KDA) LLMs."""

__version__ = "0.1.0"
