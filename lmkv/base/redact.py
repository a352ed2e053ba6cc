"""Secrets out of everything lmkv prints: logs, ``config check``, ``stats``, errors.

One place decides what a secret looks like, so every tier, plugin and
command hides the same things the same way:

* the password of a URL (``redis://user:PASS@host``, ``http://KEY:SECRET@minio``)
  and query parameters with secret names (``?password=...``);
* values under names that say they hold a secret (``is_secret_name``: a word
  such as ``password``, ``secret``, ``token``; or a key of a secret kind, such
  as ``api_key``, ``private_key``, ``aws_access_key_id``), in any mapping:
  plugin options, ``storage_options``;
* a bare ``key`` beside a bare ``secret`` (s3fs's and MinIO's pair);
* secret strings a component knows it holds (``Redactor``), replaced wherever
  they show up in a message (an exception from a client library, say).

Nothing else is masked: ``key`` alone, a public key (``server_key``,
``authorized_keys``) and a name that says where a secret lives rather than
what it is (``tls_key_file``, ``password_file``) are shown as they are, so
``config check`` shows what a user needs to see. Typed secrets (pydantic's
``SecretStr``) are masked whatever their name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
_WORDS = frozenset({"password", "passwd", "pass", "pwd", "secret", "token", "credential",
                    "credentials", "auth", "authorization", "apikey", "passphrase", "sas"})
#: What a word before ``key`` (or ``key_id``) says to make it a secret: an API key,
#: a private key, a cloud account's or session's key. Any other (``server_key``,
#: ``public_key``, ``partition_key``, ``key`` alone) names no secret.
_SECRET_KEY_KINDS = frozenset({"api", "access", "private", "secret", "account", "session",
                               "master", "signing", "encryption", "shared", "customer",
                               "client"})
#: Whole names that hold a secret though no word of theirs says so (Azure's
#: connection string carries its account key).
_SECRET_NAMES = frozenset({"connection_string", "conn_str"})
#: A last word that makes the name where a secret lives, not the secret.
_PLACES = frozenset({"file", "filename", "path", "dir", "directory", "url", "uri"})
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def is_secret_name(name: object) -> bool:
    """Whether a setting called ``name`` holds a secret.

    Its words (split at ``_``, ``-``, ``.`` and camelCase) hold a secret word
    (``password``, ``secret``, ``token``, ...; ``client_secret``,
    ``secretAccessKey``), or end in ``key`` or ``key_id`` after a secret kind
    (``api_key``, ``private_key``, ``aws_access_key_id``). Not when the last
    word names a place (``tls_key_file``, ``password_file``, ``token_url``):
    that is where the secret is. ``key`` alone, ``key_prefix``, ``server_key``
    and ``authorized_keys`` are no secrets."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(name))
    parts = [p for p in re.split(r"[^a-z0-9]+", spaced.lower()) if p]
    if not parts or parts[-1] in _PLACES:
        return False
    if any(p in _WORDS for p in parts) or "_".join(parts) in _SECRET_NAMES:
        return True
    stem = parts[:-1] if parts[-1] == "id" else parts
    return len(stem) >= 2 and stem[-1] == "key" and stem[-2] in _SECRET_KEY_KINDS


def _secret_in(mapping: Mapping[Any, Any], name: object) -> bool:
    """Whether ``mapping[name]`` is a secret: by its name, or a bare ``key`` beside a
    bare ``secret`` (s3fs's and MinIO's pair: the key is the secret's id)."""
    if is_secret_name(name):
        return True
    return str(name).lower() == "key" and any(str(other).lower() == "secret"
                                              for other in mapping)


def redact_url(url: str) -> str:
    """``url`` with its password and secret query values replaced by ``***``."""
    try:
        parts = urlsplit(url)
        password = parts.password
        port = parts.port
    except ValueError:  # a malformed port or host: show nothing that may hide a secret
        return "<unparsable url>"
    netloc = parts.netloc
    if password is not None or "@" in netloc:
        user = parts.username or ""
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        if port is not None:
            host += f":{port}"
        userinfo = f"{user}:{MASK}" if password is not None else user
        netloc = f"{userinfo}@{host}" if userinfo else host
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(is_secret_name(k) for k, _ in pairs):
            query = urlencode([(k, MASK if is_secret_name(k) else v) for k, v in pairs],
                              safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every URL redacted and every string of ``secrets`` masked."""
    if "://" in text:
        text = _URL.sub(lambda m: _redact_found_url(m.group(0)), text)
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return text


def _redact_found_url(url: str) -> str:
    """A URL found in free text: rewritten only when it carries a secret."""
    if "@" not in url and not _url_secrets(url):
        return url
    return redact_url(url)


def redact_value(value: Any, name: object = None) -> Any:
    """A copy of ``value`` (plain data) safe to print: values under secret names
    masked, URLs redacted, mappings and lists walked."""
    if name is not None and is_secret_name(name) and value not in (None, "", {}, []):
        return MASK
    if isinstance(value, Mapping):
        return {k: MASK if _secret_in(value, k) and v not in (None, "", {}, [])
                else redact_value(v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_value(v) for v in value)
    if isinstance(value, str) and "://" in value:
        return redact_text(value)
    if hasattr(value, "get_secret_value"):  # pydantic SecretStr / SecretBytes
        return MASK
    return value


class Redactor:
    """Masks the secrets one component holds in any text it is about to print."""

    __slots__ = ("_secrets",)

    def __init__(self, secrets: Iterable[object] = ()) -> None:
        values = []
        for secret in secrets:
            if hasattr(secret, "get_secret_value"):
                secret = secret.get_secret_value()
            if isinstance(secret, str) and len(secret) >= 3:  # shorter: would mask noise
                values.append(secret)
        # Longest first: a secret that contains another is masked whole.
        self._secrets = tuple(sorted(set(values), key=len, reverse=True))

    def __call__(self, text: object) -> str:
        return redact_text(str(text), self._secrets)


def secrets_in(value: Any, name: object = None) -> list[str]:
    """Secret strings found in plain data: values under secret names and URL passwords."""
    found: list[str] = []
    if hasattr(value, "get_secret_value"):
        value = value.get_secret_value()
    if isinstance(value, Mapping):
        for k, v in value.items():
            if isinstance(v, str) and v and _secret_in(value, k):
                found.append(v)
            else:
                found += secrets_in(v, k)
    elif isinstance(value, (list, tuple)):
        for v in value:
            found += secrets_in(v)
    elif isinstance(value, str):
        if name is not None and is_secret_name(name):
            found.append(value)
        elif "://" in value:
            found += _url_secrets(value)
    return found


def _url_secrets(url: str) -> list[str]:
    try:
        parts = urlsplit(url)
        out = [parts.password] if parts.password else []
    except ValueError:
        return []
    out += [v for k, v in parse_qsl(parts.query) if is_secret_name(k) and v]
    return out


class RedactedRepr:
    """Mixin for pydantic models whose repr (and str) may land in logs and
    tracebacks: every field goes through ``redact_value``."""

    def __repr_args__(self) -> Iterable[tuple[str | None, Any]]:
        for name, value in super().__repr_args__():  # type: ignore[misc]
            yield name, redact_value(value, name)
