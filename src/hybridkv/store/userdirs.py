"""Per-user default directories (a machine shared by several users and runs).

hybridkv keeps what it builds and runs by default (the loopback store's state and logs, the
Mooncake loopback shim) under one directory per user, never one shared by every user:

1. ``$XDG_CACHE_HOME/hybridkv`` when ``XDG_CACHE_HOME`` is set to an absolute path (the XDG base
   directory rule: a relative value is ignored);
2. else ``~/.cache/hybridkv`` when the home directory exists and belongs to this user;
3. else (no home, or one shared with other users, e.g. ``HOME=/``) ``<tmp>/hybridkv-<uid>`` in the
   system's temporary directory, created private (mode 0700) and refused when another user owns it.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def user_cache_dir(create: bool = False) -> Path:
    """hybridkv's cache directory for this user (rules in the module docstring).

    Args:
        create: make the temporary-directory fallback (private, :func:`private_dir`) and check
            it is this user's; ``False`` only names it (for help texts).

    Raises:
        PermissionError: ``create`` and the fallback directory belongs to another user.
        OSError: ``create`` and the fallback directory cannot be made.
    """
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "hybridkv"
    home = os.path.expanduser("~")
    try:
        own = os.path.isabs(home) and os.stat(home).st_uid == os.getuid()
    except OSError:
        own = False
    if own:
        return Path(home) / ".cache" / "hybridkv"
    fallback = Path(tempfile.gettempdir()) / f"hybridkv-{os.getuid()}"
    return private_dir(fallback) if create else fallback


def private_dir(path: Path) -> Path:
    """``path`` created with mode 0700 if missing; returned when it is a directory this user owns.

    Raises:
        PermissionError: ``path`` exists and is not a directory owned by this user (another user
            made it first: using it would share, or let them replace, this user's files).
        OSError: it cannot be created.
    """
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a directory of this user (uid {os.getuid()}); "
                              "set XDG_CACHE_HOME to a directory of your own")
    return path
