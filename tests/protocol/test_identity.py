"""Node identities: Ed25519 keys on disk, self-certifying node ids, signatures."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from meshfl.protocol.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    KeyFileError,
    node_id,
    verify,
)


def test_save_writes_pem_readable_by_owner_only(tmp_path):
    path = tmp_path / "node.key"
    Identity.generate().save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text()
    assert text.startswith("-----BEGIN PRIVATE KEY-----\n")
    assert text.rstrip().endswith("-----END PRIVATE KEY-----")


def test_save_creates_missing_directories(tmp_path):
    path = tmp_path / "a" / "b" / "node.key"
    Identity.generate().save(path)
    assert path.is_file()


def test_save_refuses_to_overwrite(tmp_path):
    path = tmp_path / "node.key"
    first = Identity.generate()
    first.save(path)
    before = path.read_bytes()
    with pytest.raises(KeyFileError, match="refusing to overwrite"):
        Identity.generate().save(path)
    assert path.read_bytes() == before
    assert Identity.load(path).id == first.id


def test_save_refuses_to_overwrite_any_existing_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not a key, but still not ours to replace")
    with pytest.raises(KeyFileError):
        Identity.generate().save(path)
    assert path.read_text() == "not a key, but still not ours to replace"


def test_load_round_trip_keeps_the_node_id(tmp_path):
    path = tmp_path / "node.key"
    original = Identity.generate()
    original.save(path)
    loaded = Identity.load(path)
    assert loaded.id == original.id
    assert loaded.public_key == original.public_key
    # The loaded private key is the same key: it signs what the original verifies.
    assert verify(original.public_key, loaded.sign(b"hello"), b"hello")


def test_load_or_create_creates_once_then_loads(tmp_path):
    path = tmp_path / "keys" / "node.key"
    created = Identity.load_or_create(path)
    assert path.is_file()
    assert Identity.load_or_create(path).id == created.id


def test_node_id_is_truncated_sha256_of_the_raw_public_key():
    identity = Identity.generate()
    assert len(identity.public_key) == PUBLIC_KEY_BYTES
    expected = hashlib.sha256(identity.public_key).digest()[:16].hex()
    assert identity.id == expected == node_id(identity.public_key)
    assert len(identity.id) == 32
    assert Identity.generate().id != identity.id


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"garbage\n",
        b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        bytes(range(256)),
    ],
    ids=["empty", "text", "broken-pem", "binary"],
)
def test_load_garbage_is_a_one_line_key_file_error(tmp_path, content):
    path = tmp_path / "node.key"
    path.write_bytes(content)
    with pytest.raises(KeyFileError) as caught:
        Identity.load(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message


def test_load_missing_file_is_a_one_line_key_file_error(tmp_path):
    path = tmp_path / "missing.key"
    with pytest.raises(KeyFileError) as caught:
        Identity.load(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    assert caught.value.__cause__ is None  # no chained OSError traceback for the user


def test_load_rejects_a_key_of_another_type(tmp_path):
    path = tmp_path / "ec.key"
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path.write_bytes(pem)
    with pytest.raises(KeyFileError, match="not an Ed25519 key"):
        Identity.load(path)


def test_load_rejects_an_encrypted_key(tmp_path):
    path = tmp_path / "locked.key"
    identity = Identity.generate()
    pem = identity._private_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )
    path.write_bytes(pem)
    with pytest.raises(KeyFileError) as caught:
        Identity.load(path)
    assert "\n" not in str(caught.value)


def test_sign_and_verify():
    alice, bob = Identity.generate(), Identity.generate()
    signature = alice.sign(b"round 3 model")
    assert len(signature) == SIGNATURE_BYTES
    assert verify(alice.public_key, signature, b"round 3 model")
    assert not verify(alice.public_key, signature, b"round 4 model")
    assert not verify(bob.public_key, signature, b"round 3 model")
    tampered = bytes([signature[0] ^ 1]) + signature[1:]
    assert not verify(alice.public_key, tampered, b"round 3 model")


@pytest.mark.parametrize(
    "public_key, signature",
    [(b"", b"\0" * 64), (b"\1" * 31, b"\0" * 64), (None, b""), (None, b"\0" * 63)],
    ids=["empty-key", "short-key", "empty-signature", "short-signature"],
)
def test_verify_malformed_inputs_is_false_not_an_exception(public_key, signature):
    key = public_key if public_key is not None else Identity.generate().public_key
    assert verify(key, signature, b"data") is False
