"""How a node started from a config dials the others of an encrypted mesh.

An encrypted node can only be dialled by whoever knows its public key (WIRE.md 1.1),
so a bootstrap entry is a contact, KEY@tcp://HOST:PORT, wherever the key is known:

1. the peer's `public_key` in peers.yaml (a LAN mesh, and every closed mesh, lists them);
2. else its key file, when it runs on this machine under the same --out (the local
   meshes of `meshfl launch` and of peers.yaml's example). Each node writes its own key
   before it reads the others', so of any two nodes started together at least the later
   one finds the earlier one's key and dials it; the earlier one learns the later one's
   key from that signed hello, and everyone else's from the peer lists.

A peer whose key is known neither way is left bare: the node dials it once another
node's peer list names its key.
"""

from __future__ import annotations

import functools
from pathlib import Path

from meshfl.node import config as cfgmod
from meshfl.node.coordinator import COORDINATOR
from meshfl.protocol.identity import Identity, KeyFileError
from meshfl.protocol.transport import BadContact, contact, split_contact

from .errors import UserError


def key_path(out: Path, name: str, key: str | None = None) -> Path:
    """Where a node named `name` keeps its private key when no --key is given."""
    return Path(key) if key else out / "keys" / f"{name}.pem"


def _known_key(peer: cfgmod.PeerConfig | None, path: Path) -> bytes | None:
    if peer is not None and peer.public_key:
        return bytes.fromhex(peer.public_key)
    try:
        return _public_key_in(path)
    except KeyFileError:
        return None  # none yet, or unreadable here: the node learns it from the mesh


@functools.lru_cache(maxsize=65536)
def _public_key_in(path: Path) -> bytes:
    """The public key of a key file, read once in a process: key files are never
    rewritten, and each node of a host lists every peer."""
    return Identity.load(path).public_key


def _contact_or_address(address: str, public_key: bytes | None) -> str:
    return contact(address, public_key) if public_key is not None else address


def listed_contacts(cfg: cfgmod.MeshConfig, out: Path, but: str) -> list[str]:
    """Contacts of the coordinator (if any) and of every listed peer except `but`."""
    contacts = []
    if cfg.coordinator and but != COORDINATOR:
        path = key_path(out, COORDINATOR)
        contacts.append(_contact_or_address(cfg.coordinator, _known_key(None, path)))
    for peer in cfg.peers:
        if peer.name != but:
            path = key_path(out, peer.name, peer.key)
            contacts.append(_contact_or_address(peer.listen, _known_key(peer, path)))
    return contacts


def join_contact(cfg: cfgmod.MeshConfig, out: Path, given: str) -> str:
    """The contact `meshfl join` dials: `given` when it carries a key, else the listed
    peer at that address, when its key is known. UserError when an encrypted mesh
    leaves the key unknown: the joiner could not say hello at all."""
    try:
        address, public_key = split_contact(given)
    except BadContact as err:
        raise UserError(f"ADDR: {err}") from None
    if public_key is not None or not cfg.encrypt:
        return given
    listed = next((peer for peer in cfg.peers if peer.listen == address), None)
    if listed is not None:
        public_key = _known_key(listed, key_path(out, listed.name, listed.key))
    if public_key is None:
        raise UserError(
            f"ADDR: {address} belongs to an encrypted mesh and its node's public "
            "key is unknown here; give KEY@tcp://HOST:PORT (the node logs it at "
            "start, `meshfl launch` prints it) or list its public_key in --config"
        )
    return contact(address, public_key)


def own_contact(cfg: cfgmod.MeshConfig, address: str, path: Path) -> str:
    """How the next node dials this one (its key is made here if it has none yet)."""
    if not cfg.encrypt:
        return address
    return contact(address, Identity.load_or_create(path).public_key)
