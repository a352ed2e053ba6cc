"""CURVE key files (lmkv.rpc.auth) and ``lmkv keygen``: what is written, what is refused."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq

from lmkv.base.errors import ConfigError
from lmkv.cli.commands import main as lmkv_main
from lmkv.config.model import CurveConfig, load_config
from lmkv.rpc.auth import (
    AuthError,
    client_keys,
    load_authorized_keys,
    load_keypair,
    load_public_key,
    peer_keys,
    server_keys,
    write_keypair,
)

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keygen_writes_an_owner_only_secret_and_a_readable_public_key(tmp_path, capsys) -> None:
    os.umask(0o022)
    keys = tmp_path / "new" / "keys"
    assert lmkv_main(["keygen", "--dir", str(keys), "--name", "node1"]) == 0
    public, secret = keys / "node1.key", keys / "node1.key_secret"
    assert (mode(keys), mode(secret), mode(public)) == (0o700, 0o600, 0o644)
    pair = load_keypair(secret)
    assert load_public_key(public) == pair[0] == zmq.curve_public(pair[1])
    out = capsys.readouterr().out
    assert pair[0].decode() in out and pair[1].decode() not in out  # the secret never prints
    # zmq's own loader reads the same files.
    assert zmq.auth.load_certificate(secret) == pair


def test_keygen_never_overwrites_without_force(tmp_path, capsys) -> None:
    assert lmkv_main(["keygen", "--dir", str(tmp_path)]) == 0
    first = load_keypair(tmp_path / "lmkv.key_secret")
    capsys.readouterr()
    assert lmkv_main(["keygen", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exists; pass --force" in err[0]
    assert load_keypair(tmp_path / "lmkv.key_secret") == first
    assert lmkv_main(["keygen", "--dir", str(tmp_path), "--force"]) == 0
    assert load_keypair(tmp_path / "lmkv.key_secret") != first
    assert mode(tmp_path / "lmkv.key_secret") == 0o600
    assert lmkv_main(["keygen", "--dir", str(tmp_path), "--name", "../x"]) == 2
    assert "key name '../x'" in capsys.readouterr().err


@pytest.mark.parametrize("bits", [0o640, 0o604, 0o620, 0o660, 0o644])
def test_a_secret_key_others_can_touch_is_refused(tmp_path, bits) -> None:
    _, secret = write_keypair(tmp_path, "k")
    secret.chmod(bits)
    with pytest.raises(AuthError) as info:
        load_keypair(secret)
    text = str(info.value)
    assert "\n" not in text and f"mode {bits:04o}" in text and "chmod 600" in text


def test_an_owner_read_only_secret_key_is_fine(tmp_path) -> None:
    _, secret = write_keypair(tmp_path, "k")
    secret.chmod(0o400)
    assert len(load_keypair(secret)[1]) == 40


@pytest.mark.parametrize("text,message", [
    ('curve\n    public-key = "abc"\n', "not a 40-character Z85 key"),
    ("nothing here\n", "no secret-key line"),
])
def test_malformed_secret_key_files_are_one_line(tmp_path, text, message) -> None:
    path = tmp_path / "bad.key_secret"
    path.write_text(text)
    path.chmod(0o600)
    with pytest.raises(AuthError, match=message):
        load_keypair(path)


def test_a_public_key_that_does_not_match_its_secret_is_refused(tmp_path) -> None:
    _, secret = write_keypair(tmp_path, "k")
    other = zmq.curve_keypair()[0].decode()
    text = secret.read_text()
    start = text.index('public-key = "') + len('public-key = "')
    secret.write_text(text[:start] + other + text[start + 40:])
    with pytest.raises(AuthError, match="does not belong"):
        load_keypair(secret)


def test_the_public_file_is_not_a_key_pair(tmp_path) -> None:
    public, _ = write_keypair(tmp_path, "k")
    public.chmod(0o600)
    with pytest.raises(AuthError, match=r"use the \.key_secret one"):
        load_keypair(public)
    with pytest.raises(AuthError, match="cannot read it"):
        load_keypair(tmp_path / "missing.key_secret")


def test_authorized_keys_from_a_file_or_a_directory(tmp_path) -> None:
    clients = tmp_path / "clients"
    clients.mkdir(mode=0o755)
    a, _ = write_keypair(clients, "a")
    b, _ = write_keypair(clients, "b")
    assert load_authorized_keys(clients) == {load_public_key(a), load_public_key(b)}
    assert load_authorized_keys(a) == {load_public_key(a)}
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AuthError, match=r"no \*\.key files"):
        load_authorized_keys(empty)


@pytest.mark.parametrize("target", ["dir", "file"])
def test_an_allow_list_others_can_write_is_refused(tmp_path, target) -> None:
    clients = tmp_path / "clients"
    clients.mkdir(mode=0o755)
    public, _ = write_keypair(clients, "a")
    (clients if target == "dir" else public).chmod(0o777 if target == "dir" else 0o666)
    with pytest.raises(AuthError, match="others could add keys"):
        load_authorized_keys(clients)


def test_roles_need_their_keys(tmp_path) -> None:
    _, secret = write_keypair(tmp_path, "k")
    with pytest.raises(AuthError, match="without an allow list any key"):
        server_keys(str(secret), None)
    with pytest.raises(AuthError, match="server_key: required"):
        client_keys(CurveConfig(secret_key=str(secret)))
    shared = peer_keys(CurveConfig(secret_key=str(secret)))
    assert shared.server_key == shared.public and shared.authorized == {shared.public}
    assert shared.secret.decode() not in repr(shared)


def test_the_config_refuses_a_non_loopback_tcp_lookup_without_curve(tmp_path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"lookup": {"transport": "tcp", "base_port": 7000,
                                           "host": "0.0.0.0"}})
    assert "\n" not in str(info.value) and "lookup.curve" in str(info.value)
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        load_config(overrides={"lookup": {"transport": "tcp", "base_port": 7000,
                                          "host": host}})
    _, secret = write_keypair(tmp_path, "k")
    for extra in ({"insecure": True}, {"curve": {"secret_key": str(secret)}}):
        load_config(overrides={"lookup": {"transport": "tcp", "base_port": 7000,
                                          "host": "10.1.2.3", **extra}})


def test_an_insecure_lookup_channel_warns_at_every_start(caplog) -> None:
    import logging

    from lmkv.lookup.sockets import LookupEndpoints
    config = load_config(overrides={"lookup": {"transport": "tcp", "base_port": 7000,
                                               "host": "10.1.2.3", "insecure": True}})
    with caplog.at_level(logging.WARNING, logger="lmkv"):
        LookupEndpoints.from_config(config.lookup, "e", 1)
    assert "INSECURE" in caplog.text and "10.1.2.3" in caplog.text


NOBODY = 65534  # another local user (the tests run as root, who may chown)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a file to another user")
def test_keys_another_user_owns_are_refused(tmp_path) -> None:
    """Another local user who owns a trusted key file can rewrite it at will."""
    clients = tmp_path / "clients"
    clients.mkdir(mode=0o755)
    public, _ = write_keypair(clients, "a")
    os.chown(public, NOBODY, NOBODY)
    public.chmod(0o644)
    with pytest.raises(AuthError, match=r"owned by uid 65534.*others could add keys"):
        load_authorized_keys(clients)
    with pytest.raises(AuthError, match=r"public key file .* owned by uid 65534"):
        load_public_key(public)


def test_a_public_key_others_can_change_is_not_trusted(tmp_path) -> None:
    public, _ = write_keypair(tmp_path / "keys", "server")
    public.chmod(0o666)
    with pytest.raises(AuthError, match=r"public key file .* writable by group or others"):
        load_public_key(public)


def test_keygen_never_writes_into_a_directory_others_can_change(tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(AuthError, match=r"key directory .* writable by group or others"):
        write_keypair(shared, "k")
    assert list(shared.iterdir()) == []


def test_keygen_into_an_unwritable_place_is_one_line(capsys) -> None:
    assert lmkv_main(["keygen", "--dir", "/proc/self/lmkv-no-such"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and "lmkv-no-such" in err
