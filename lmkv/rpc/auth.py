"""ZMQ CURVE for lmkv's TCP sockets: key files, key pairs and secured sockets.

A key pair file (``NAME.key_secret``, written by ``lmkv keygen``) holds a
public and a secret key; a public key file (``NAME.key``) only the public one.
Both use ZeroMQ's certificate format, so ``zmq.auth.create_certificates`` and
czmq's ``zcert`` files work too.

A bound socket becomes a CURVE server that accepts only the public keys of an
allow list (CURVE alone would encrypt, and let anyone with any key in); a
connecting socket becomes a CURVE client that proves its key pair and checks
the server's public key. A peer that fails either check never completes the
handshake: for lmkv that is a peer that does not answer, so a miss.

Secret key files must be owner-only (no group or other permission bits) and
owned by this user or root; an allow list must not be writable by others,
or anyone could add a key. Each refusal is one line (``AuthError``).
"""

from __future__ import annotations

import logging
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from lmkv.base.errors import ConfigError
from lmkv.base.logutil import RateLimitedLog
from lmkv.base.private import make_private_dir, ownership_problem
from lmkv.config.model import CurveConfig

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger, interval_s=60.0)

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
_Z85_KEY = re.compile(rb"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
_KEY_LINE = re.compile(rb'^\s*(public|secret)-key\s*=\s*["\']?([^"\'\s]*)["\']?\s*$')
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_BANNER = ("#   ZeroMQ CURVE {what} certificate, written by `lmkv keygen`.\n"
           "#   {note}\n")


class AuthError(ConfigError):
    """A key file is missing, malformed or not private enough; one line."""


def curve_available() -> bool:
    return bool(zmq.has("curve"))


def _require_curve() -> None:
    if not curve_available():
        raise AuthError(f"this libzmq ({zmq.zmq_version()}) was built without CURVE "
                        "support; install a pyzmq wheel (they bundle libsodium)")


@dataclass(frozen=True)
class CurveKeys:
    """This side's key pair, the server it connects to, and whom it lets in (z85 bytes)."""

    public: bytes
    secret: bytes
    server_key: bytes | None = None
    authorized: frozenset[bytes] = frozenset()

    def __repr__(self) -> str:  # never print the secret
        return f"CurveKeys(public={self.public.decode()!r}, secret=<hidden>)"


# -- key files -------------------------------------------------------------------

def _parse(data: bytes, path: Path) -> tuple[bytes | None, bytes | None]:
    keys: dict[bytes, bytes] = {}
    for line in data.splitlines():
        match = _KEY_LINE.match(line)
        if match:
            if not _Z85_KEY.match(match.group(2)):
                raise AuthError(f"key file {path}: the {match.group(1).decode()}-key is not "
                                "a 40-character Z85 key")
            keys.setdefault(match.group(1), match.group(2))
    return keys.get(b"public"), keys.get(b"secret")


def load_public_key(path: str | os.PathLike) -> bytes:
    """The public key in a ``.key`` (or ``.key_secret``) file."""
    path = Path(path).expanduser()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise AuthError(f"public key file {path}: cannot read it "
                        f"({exc.strerror or exc})") from None
    # Whoever can change a public key we trust becomes the peer we trust.
    problem = ownership_problem(path.stat())
    if problem:
        raise AuthError(f"public key file {path} {problem}; fix it with chown/chmod go-w")
    public, _ = _parse(data, path)
    if public is None:
        raise AuthError(f"public key file {path}: no public-key line (write one with "
                        "`lmkv keygen`)")
    return public


def load_keypair(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) from an owner-only ``.key_secret`` file."""
    _require_curve()
    path = Path(path).expanduser()
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise AuthError(f"secret key file {path}: cannot read it "
                        f"({exc.strerror or exc})") from None
    try:
        # Checked on the open file, so a swap after the check cannot slip by.
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AuthError(f"secret key file {path}: not a regular file")
        if st.st_mode & 0o077:
            raise AuthError(f"secret key file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets "
                            f"others read or change it; allowed: owner-only "
                            f"(chmod 600 {path})")
        if st.st_uid not in (os.getuid(), 0):
            raise AuthError(f"secret key file {path}: owned by uid {st.st_uid}; allowed: "
                            f"this user (uid {os.getuid()}) or root")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(1 << 16)
    finally:
        os.close(fd)
    public, secret = _parse(data, path)
    if secret is None:
        raise AuthError(f"secret key file {path}: no secret-key line (is it the public "
                        f"{PUBLIC_SUFFIX} file? use the {SECRET_SUFFIX} one)")
    derived = zmq.curve_public(secret)
    if public is not None and public != derived:
        raise AuthError(f"secret key file {path}: its public-key does not belong to its "
                        "secret-key")
    return derived, secret


def load_authorized_keys(path: str | os.PathLike) -> frozenset[bytes]:
    """The public keys of one ``.key`` file, or of every ``*.key`` file in a directory."""
    path = Path(path).expanduser()
    try:
        st = path.stat()
    except OSError as exc:
        raise AuthError(f"authorized keys {path}: cannot read it "
                        f"({exc.strerror or exc})") from None
    _check_not_writable_by_others(path, st)
    if stat.S_ISDIR(st.st_mode):
        files = sorted(p for p in path.iterdir() if p.name.endswith(PUBLIC_SUFFIX))
        for file in files:
            _check_not_writable_by_others(file, file.stat())
        keys = frozenset(load_public_key(f) for f in files)
        if not keys:
            raise AuthError(f"authorized keys {path}: no *{PUBLIC_SUFFIX} files in it; "
                            "copy the clients' public keys there")
        return keys
    return frozenset({load_public_key(path)})


def _check_not_writable_by_others(path: Path, st: os.stat_result) -> None:
    # Whoever can add a key to the allow list can let themselves in.
    problem = ownership_problem(st)
    if problem:
        raise AuthError(f"authorized keys {path} {problem}: others could add keys; fix it "
                        f"with chown/chmod go-w")


def write_keypair(directory: str | os.PathLike, name: str, *,
                  force: bool = False) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public, 0644) and ``NAME.key_secret`` (0600) into ``directory``
    (created 0700 when missing); returns their paths."""
    _require_curve()
    if not _NAME.match(name):
        raise AuthError(f"key name {name!r}: use 1-64 letters, digits, '.', '_' and '-'")
    directory = Path(directory).expanduser()
    # Another user who can write the directory could swap the public key peers trust.
    problem = make_private_dir(directory) if not directory.exists() else \
        ownership_problem(os.lstat(directory))
    if problem:
        raise AuthError(f"key directory {directory} {problem}")
    public_path = directory / f"{name}{PUBLIC_SUFFIX}"
    secret_path = directory / f"{name}{SECRET_SUFFIX}"
    if not force:
        for p in (public_path, secret_path):
            if os.path.lexists(p):
                raise AuthError(f"{p} exists; pass --force to replace it")
    public, secret = zmq.curve_keypair()
    secret_text = (_BANNER.format(what="secret", note="keep it private: whoever holds it "
                                  "is this key's owner")
                   + f'curve\n    public-key = "{public.decode()}"\n'
                   + f'    secret-key = "{secret.decode()}"\n')
    public_text = (_BANNER.format(what="public", note="give it to the peers that must "
                                  "trust this key")
                   + f'curve\n    public-key = "{public.decode()}"\n')
    # The secret file is never visible with looser permissions, not even for a moment.
    _write_new(secret_path, secret_text, 0o600)
    _write_new(public_path, public_text, 0o644)
    return public_path, secret_path


def _write_new(path: Path, text: str, mode: int) -> None:
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as exc:
        raise AuthError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# -- from the config ---------------------------------------------------------------

def server_keys(secret_key: str, authorized_keys: str | None) -> CurveKeys:
    """The keys of a CURVE server that admits only ``authorized_keys``."""
    if authorized_keys is None:
        raise AuthError("CURVE needs authorized keys (the clients' public keys, a file or a "
                        "directory): without an allow list any key would be let in")
    public, secret = load_keypair(secret_key)
    return CurveKeys(public, secret, authorized=load_authorized_keys(authorized_keys))


def client_keys(config: CurveConfig, what: str = "server.curve") -> CurveKeys:
    """The keys of a CURVE client of the server whose public key ``config`` names."""
    if config.server_key is None:
        raise AuthError(f"{what}.server_key: required (the server's public {PUBLIC_SUFFIX} "
                        "file): a client checks whom it talks to")
    public, secret = load_keypair(config.secret_key)
    return CurveKeys(public, secret, server_key=load_public_key(config.server_key))


def peer_keys(config: CurveConfig) -> CurveKeys:
    """Keys for a channel whose ends both bind and connect (the lookup channel): the
    peers' server key and allow list default to this key pair's own public key, so
    processes that share one key pair accept each other and no one else."""
    public, secret = load_keypair(config.secret_key)
    server = load_public_key(config.server_key) if config.server_key else public
    authorized = load_authorized_keys(config.authorized_keys) if config.authorized_keys \
        else frozenset({public})
    return CurveKeys(public, secret, server_key=server, authorized=authorized)


# -- sockets -----------------------------------------------------------------------

def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (before connect) a CURVE client of the server ``keys`` names."""
    if keys.server_key is None:
        raise ValueError("a CURVE client needs the server's public key")
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_key


class CurveAuthenticator:
    """Admits, on the sockets of one context that ``secure`` marks, only the authorized
    keys. It runs ZeroMQ's authentication handler (a thread) until ``stop``, which
    must come before the context is terminated."""

    def __init__(self, context: zmq.Context, keys: CurveKeys) -> None:
        if not keys.authorized:
            raise ValueError("a CURVE authenticator needs a non-empty allow list")
        self.keys = keys
        self.refused = 0
        self._auth = ThreadAuthenticator(context, log=logging.getLogger(f"{__name__}.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)

    def secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before bind) a CURVE server with this key pair."""
        sock.curve_server = True
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public

    def callback(self, domain: str, key: bytes) -> bool:
        """ZeroMQ's handler asks this for every new connection (``key`` in Z85)."""
        if key in self.keys.authorized:
            return True
        self.refused += 1
        _log.warning("refused", "lmkv: refused a connection from an unauthorized CURVE key "
                     "%s (%d refused so far)", key.decode(errors="replace"), self.refused)
        return False

    def stop(self) -> None:
        self._auth.stop()

