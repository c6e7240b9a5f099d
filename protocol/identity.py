"""Ed25519 identities: a node *is* its public key.

The node id is derived from the public key, so it cannot be self-declared: a
message claiming an id must carry the key that hashes to it and a signature
that key made.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from .errors import UserError

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
# The prime of Curve25519 and Edwards25519: both curves share the field.
_FIELD_PRIME = 2**255 - 19
# Edwards25519: -x^2 + y^2 = 1 + d x^2 y^2 (RFC 8032, section 5.1).
_EDWARDS_D = -121665 * pow(121666, _FIELD_PRIME - 2, _FIELD_PRIME) % _FIELD_PRIME
# The y of the eight points of order <= 8 ("small order"): the neutral point (y = 1), one
# of order 2 (y = -1), two of order 4 (y = 0) and four of order 8 (y = +-c).
_ORDER_8_Y = int.from_bytes(
    bytes.fromhex("c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a"), "little"
)
_SMALL_ORDER_Y = frozenset({1, _FIELD_PRIME - 1, 0, _ORDER_8_Y, _FIELD_PRIME - _ORDER_8_Y})
# The reason a message is refused when a key in it is none a node could hold (WIRE.md 2).
WEAK_KEY = "weak_key"


class KeyFileError(UserError):
    """A key file that cannot be used; the message is one line for the user."""


def node_id(public_key: bytes) -> str:
    """The self-certifying id of a node: hex of sha256(raw public key)[:16]."""
    return hashlib.sha256(public_key).digest()[:16].hex()


def verify(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """True when `signature` is `public_key`'s Ed25519 signature of `data`."""
    try:
        _verifier(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


@functools.lru_cache(maxsize=8192)
def _verifier(public_key: bytes) -> Ed25519PublicKey:
    """The key, loaded once: a node verifies its few neighbours' every message. Bytes
    that are no key raise ValueError, and are not kept."""
    return Ed25519PublicKey.from_public_bytes(public_key)


@functools.lru_cache(maxsize=8192)
def is_usable_public_key(public_key: bytes) -> bool:
    """True when `public_key` is the canonical encoding (y < p) of an Edwards25519 point
    of large order, the only kind a private key makes. A key of small order signs any
    message at all (OpenSSL verifies such signatures) and has no CURVE twin to dial;
    bytes that are no point on the curve verify nothing. The top bit (the sign of x) is
    free: each y < p but those of small order has two points, both usable."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        return False
    y = int.from_bytes(public_key, "little") & ((1 << 255) - 1)
    if y >= _FIELD_PRIME or y in _SMALL_ORDER_Y:
        return False
    # A point has this y when x^2 = (y^2 - 1) / (d y^2 + 1) has a root: when the
    # numerator times the denominator is a square (Euler's criterion).
    p = _FIELD_PRIME
    return pow((y * y - 1) * (_EDWARDS_D * y * y + 1) % p, (p - 1) // 2, p) == 1


class BadPublicKey(ValueError):
    """Bytes that are not an Ed25519 public key with a Curve25519 counterpart."""


@functools.lru_cache(maxsize=8192)  # a field inversion, asked for every message sent
def curve_public_key(public_key: bytes) -> bytes:
    """The X25519 (CURVE) public key bound to an Ed25519 public key: the Montgomery u of
    the same point, u = (1 + y) / (1 - y) mod 2^255 - 19 (RFC 7748, section 4.1), as 32
    little-endian bytes. Anyone holding a node's Ed25519 key can dial it encrypted.
    """
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise BadPublicKey(f"a public key has {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    if not is_usable_public_key(public_key):
        raise BadPublicKey(
            "not the canonical encoding of an Edwards25519 point of large order: no node "
            "can hold this key"
        )
    # The top bit is the sign of x, which the Montgomery form does not need.
    y = int.from_bytes(public_key, "little") & ((1 << 255) - 1)
    u = (1 + y) * pow(1 - y, _FIELD_PRIME - 2, _FIELD_PRIME) % _FIELD_PRIME
    return u.to_bytes(PUBLIC_KEY_BYTES, "little")


def curve_secret_key(seed: bytes) -> bytes:
    """The X25519 secret key bound to an Ed25519 private key (its 32-byte seed): the
    clamped first half of SHA-512(seed), which is the scalar Ed25519 itself multiplies
    the base point by (RFC 8032, section 5.1.5), so its X25519 public key is
    `curve_public_key` of the Ed25519 public key."""
    scalar = bytearray(hashlib.sha512(seed).digest()[:32])
    scalar[0] &= 248
    scalar[31] &= 127
    scalar[31] |= 64
    return bytes(scalar)


class Identity:
    """A private key and what follows from it."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.id: str = node_id(self.public_key)
        # The CURVE key pair of the encrypted transport, derived from this very key, so
        # one key file and one allowlist serve both signatures and encryption.
        self.curve_public_key = curve_public_key(self.public_key)
        self.curve_secret_key = curve_secret_key(
            private_key.private_bytes(
                serialization.Encoding.Raw,
                serialization.PrivateFormat.Raw,
                serialization.NoEncryption(),
            )
        )

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: str | Path) -> Identity:
        try:
            pem = Path(path).read_bytes()
            key = serialization.load_pem_private_key(pem, password=None)
        except OSError as err:
            raise KeyFileError(f"cannot read key file {path}: {err.strerror}") from None
        except (ValueError, TypeError):
            raise KeyFileError(f"key file {path} is not an unencrypted PEM private key") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"key file {path} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str | Path) -> Identity:
        """The key at `path`, written there first if there is none yet."""
        if Path(path).exists():
            return cls.load(path)
        identity = cls.generate()
        identity.save(path)
        return identity

    def save(self, path: str | Path) -> None:
        """Write the key as PEM, readable by the owner only; never overwrite a key."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = self._private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        try:
            # O_EXCL: two processes racing to create the same key must not both win.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise KeyFileError(f"{path} already exists; refusing to overwrite a key") from None
        except OSError as err:
            raise KeyFileError(f"cannot write key file {path}: {err.strerror}") from None
        with os.fdopen(fd, "wb") as out:
            out.write(pem)

    def sign(self, data: bytes) -> bytes:
        return self._private_key.sign(data)
