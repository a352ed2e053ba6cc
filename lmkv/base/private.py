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
import tempfile
from pathlib import Path

SERVER_SOCKET = "server.sock"


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


def default_runtime_dir() -> Path:
    """``$XDG_RUNTIME_DIR/lmkv`` when that is set, else ``{tmp}/lmkv-{uid}``: where
    this user's sockets live (lookup channel, the ``lmkv server``'s default)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "lmkv"
    return Path(tempfile.gettempdir()) / f"lmkv-{os.getuid()}"


def default_server_address() -> str:
    """The ``lmkv server``'s default address: an ipc socket in this user's private
    runtime directory (no other local user can connect, or bind it first)."""
    return f"ipc://{default_runtime_dir() / SERVER_SOCKET}"


def ipc_dir_problem(address: str, *, create: bool) -> str | None:
    """For an ``ipc://`` address: why its directory is not private (created 0700 first
    when ``create``); None when it is, and for any other address."""
    if not address.startswith("ipc://"):
        return None
    directory = Path(address[len("ipc://"):]).parent
    if create:
        problem = make_private_dir(directory)
    else:
        try:
            problem = private_dir_problem(directory)
        except FileNotFoundError:
            return None  # nothing there yet: nobody else's socket either
    return f"socket directory {directory} {problem}" if problem else None
