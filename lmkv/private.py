"""What this user may trust on a shared machine: private directories and files
others cannot change.

Everything lmkv binds, writes or reads keys from on a local filesystem goes
through here, so another local user can neither pre-create a predictable path
(and receive what was meant for us) nor change a file we trust (and let
themselves in). One line names the path and the problem; nothing else is
touched.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def ownership_problem(info: os.stat_result) -> str | None:
    """Why a file or directory with ``info`` is not ours alone to change; None when
    it is: owned by this user (or root) and writable by nobody else."""
    uid = os.geteuid()
    if info.st_uid not in (uid, 0):
        return f"is owned by uid {info.st_uid}, not by this user (uid {uid}) or root"
    if info.st_mode & 0o022:
        return (f"has mode {stat.S_IMODE(info.st_mode):04o}: writable by group or others "
                "(allowed: writable by its owner only)")
    return None


def private_dir_problem(directory: Path) -> str | None:
    """Why ``directory`` is not a private directory (a real directory, owned by this
    user, writable by nobody else); None when it is."""
    info = os.lstat(directory)
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link; a real directory is required"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    return ownership_problem(info)


def make_private_dir(directory: Path) -> str | None:
    """Create ``directory`` owner-only (0700, parents as needed), or check an existing
    one; why it cannot be used, or None."""
    try:
        directory.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot be created: {exc.strerror or exc}"
    return private_dir_problem(directory)
