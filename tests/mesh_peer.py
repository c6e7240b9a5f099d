"""One mesh node in its own process, driven by tests/meshes/test_mesh_processes.py.

    python tests/mesh_peer.py --name NAME --key KEYFILE [--bootstrap ADDRESS ...]

It listens on a free loopback port, joins through the bootstrap addresses, prints
{"event": "ready", ...} and then runs the commands it reads on stdin, one a line,
answering each with one JSON line on stdout:

    peers COUNT SECONDS           wait until COUNT peers are alive; list them
    publish ROUND MEGABYTES SEED  publish a blob of random float32; its digest
    fetch ROUND SECONDS KEY...    fetch what these origins (hex public keys) announced
                                  in ROUND and check every digest and signature
    state ID STATE SECONDS        wait until peer ID is in STATE (alive, down, left)
    quit                          say bye and exit

Logs go to stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time

import numpy as np

from meshfl.protocol.endpoint import Endpoint, EndpointSettings
from meshfl.protocol.identity import Identity, verify
from meshfl.protocol.ports import free_ports
from meshfl.protocol.transport import TransportError
from meshfl.protocol.wire import RECORD_CONTEXT, frames_digest, make_blob

MESH = hashlib.sha256(b"meshfl multi-process test").digest()[:16]


def say(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def open_endpoint(args: argparse.Namespace) -> Endpoint:
    identity = Identity.load(args.key)
    for _ in range(10):  # the free port may be taken before we bind it
        settings = EndpointSettings(
            args.name,
            f"tcp://127.0.0.1:{free_ports(1)[0]}",
            heartbeat_interval=args.heartbeat,
            peer_timeout=args.timeout,
        )
        try:
            return Endpoint(identity, MESH, settings)
        except TransportError:
            continue
    raise SystemExit("no free port")


def cmd_peers(endpoint: Endpoint, count: str, seconds: str) -> None:
    ok = endpoint.wait_for_peers(int(count), float(seconds))
    say("peers", ok=ok, alive=sorted(entry.id for entry in endpoint.alive_peers()))


def cmd_publish(endpoint: Endpoint, round_no: str, megabytes: str, seed: str) -> None:
    values = int(float(megabytes) * 1e6) // 4
    weights = np.random.default_rng(int(seed)).random(values, dtype=np.float32)
    blob = make_blob(endpoint.identity, int(round_no), "model", {"weights": weights})
    endpoint.set_round(int(round_no))
    endpoint.publish(blob)
    say("published", origin=blob.origin.hex(), digest=blob.digest.hex(), size=blob.size)


def cmd_fetch(endpoint: Endpoint, round_no: str, seconds: str, *origins: str) -> None:
    deadline = time.monotonic() + float(seconds)
    wanted = {bytes.fromhex(origin) for origin in origins}
    offers = [
        offer
        for offer in endpoint.wait_offers(int(round_no), {"model"}, wanted, deadline)
        if offer.origin in wanted
    ]
    endpoint.fetch(offers)
    got = endpoint.wait_blobs([offer.id for offer in offers], deadline)
    blobs = []
    for offer in offers:
        blob = got.get(offer.id)
        if blob is None:
            continue
        blobs.append(
            {
                "origin": blob.origin.hex(),
                "digest": blob.digest.hex(),
                "size": blob.size,
                "origin_ok": blob.origin == offer.origin,
                "digest_ok": frames_digest(blob.frames) == blob.digest == offer.digest,
                "signature_ok": verify(blob.origin, blob.signature, RECORD_CONTEXT + blob.record),
            }
        )
    say("fetched", blobs=blobs, announced=len(offers))


def cmd_state(endpoint: Endpoint, peer_id: str, state: str, seconds: str) -> None:
    deadline = time.monotonic() + float(seconds)
    while True:
        entry = {entry.id: entry for entry in endpoint.peers()}.get(peer_id)
        now = entry.state if entry else None
        if now == state or time.monotonic() > deadline:
            # How long the peer had been silent, on this node's clock, when seen so.
            silent = time.monotonic() - entry.last_seen if entry else None
            say("state", ok=now == state, state=now, silent=silent)
            return
        time.sleep(0.01)


COMMANDS = {"peers": cmd_peers, "publish": cmd_publish, "fetch": cmd_fetch, "state": cmd_state}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--key", required=True, help="Ed25519 private key (PEM)")
    parser.add_argument("--bootstrap", action="append", default=[], help="address to join")
    parser.add_argument("--heartbeat", type=float, default=0.25, help="seconds")
    parser.add_argument("--timeout", type=float, default=1.5, help="peer timeout, seconds")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s {args.name} %(name)s: %(message)s",
    )

    endpoint = open_endpoint(args)
    try:
        endpoint.start(args.bootstrap)
        joined = endpoint.wait_joined(10.0)
        say(
            "ready",
            id=endpoint.id,
            key=endpoint.identity.public_key.hex(),
            address=endpoint.settings.address,
            contact=endpoint.contact,
            joined=joined,
        )
        for line in sys.stdin:
            words = line.split()
            if not words:
                continue
            if words[0] == "quit":
                break
            command = COMMANDS.get(words[0])
            if command is None:
                say("error", message=f"unknown command {words[0]!r}")
                continue
            command(endpoint, *words[1:])
    finally:
        endpoint.close()
    say("bye")
    return 0


if __name__ == "__main__":
    sys.exit(main())
