"""The cache ABI version, defined once (docs/reference/cache-abi.md).

It names the layout of everything a lower tier or the store holds: object keys
(``hkv<version>/<namespace>/<owner>/<chain>/<group>/r<rank>/<component>``), manifests and
payload encodings. Bump it when any of those changes; older versions are purged by their
key prefix, the current one by owners.
"""

ABI_VERSION = 5
"""Current cache ABI version (int)."""

KEY_PREFIX = f"hkv{ABI_VERSION}"
"""First segment of every object key of the current ABI."""
