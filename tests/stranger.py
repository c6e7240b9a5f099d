"""A stranger on the wire: a client written from protocol/WIRE.md, who can reach a node's
port and tries everything section 9 and section 7 must turn away, for
tests/hostile/test_strangers.py and for a soak against a live mesh:

    python -m tests.stranger soak --minutes 30 --out RUN

The soak launches a 4-node mesh (`meshfl launch`), cycles through every case below
against all its nodes until the mesh has run for the given time, asks each node its
`meshfl status` throughout, and prints the nodes' processes' memory (RSS) and open
files at the start and the end, then whether every node finished every round
(`--no-attack`: the same mesh left alone, the baseline to compare with).

    python -m tests.stranger flood --out RUN

sends 1000 hellos from fresh keys naming unreachable addresses to node0 of a 2-node
launch and prints, every 5 s for a minute, its open files, peer table and log size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from meshfl.protocol.decoder import Decoder
from meshfl.protocol.identity import Identity, curve_public_key
from meshfl.protocol.ports import free_ports
from meshfl.protocol.probe import ask_status
from meshfl.protocol.transport import (
    Encryption,
    curve_client,
    curve_server,
    split_contact,
)
from meshfl.protocol.wire import (
    Blob,
    Message,
    Rejected,
    encode,
    frames_digest,
    make_blob,
    new_instance,
)

FIELD_PRIME = 2**255 - 19
# The y of the points of order <= 8 on Edwards25519 (WIRE.md 2): 1 (neutral), p - 1
# (order 2), 0 (order 4), and +-c (order 8).
ORDER_8_Y = int.from_bytes(
    bytes.fromhex("c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a"), "little"
)
SMALL_ORDER_Y = (1, FIELD_PRIME - 1, 0, ORDER_8_Y, FIELD_PRIME - ORDER_8_Y)
NEUTRAL_KEY = (1).to_bytes(32, "little")
# Verifies under the neutral key for any message: R = the neutral point, S = 0.
ANY_MESSAGE_SIGNATURE = NEUTRAL_KEY + bytes(32)
UNUSABLE_ADDRESSES = ("garbage", "", "udp://127.0.0.1:9", "tcp://*:5555", "ipc:///tmp/x")


def _encoding(y: int, x_is_odd: int) -> bytes:
    return (y | x_is_odd << 255).to_bytes(32, "little")


def small_order_keys() -> list[bytes]:
    """Every 32-byte encoding of a point of order <= 8: the eight points written
    canonically, with the sign bit of x set where x = 0 (y = +-1), and with y + p for
    the y small enough to be written so (0 and 1)."""
    keys = {_encoding(y, odd) for y in SMALL_ORDER_Y for odd in (0, 1)}
    keys |= {_encoding(y + FIELD_PRIME, odd) for y in SMALL_ORDER_Y if y < 19 for odd in (0, 1)}
    return sorted(keys)


def unreachable_addresses(count: int) -> list[str]:
    """Addresses where nobody answers, alternately a closed loopback port (refused at
    once) and one on a documentation network (never answered)."""
    closed = [f"tcp://127.0.0.1:{port}" for port in free_ports(min(count, 64))]
    return [
        closed[index % len(closed)] if index % 2 else f"tcp://192.0.2.{1 + index % 254}:9"
        for index in range(count)
    ]


class Stranger:
    """One process's sockets aimed at one node: a DEALER to it, a ROUTER for answers."""

    def __init__(self, node_contact: str, mesh_id: bytes, context: zmq.Context) -> None:
        self.node_address, self.node_key = split_contact(node_contact)
        assert self.node_key is not None, "a contact KEY@tcp://HOST:PORT"
        self.mesh_id = mesh_id
        self.context = context
        self.identity = Identity.generate()
        self.instance = new_instance()
        keys = Encryption(self.identity.curve_public_key, self.identity.curve_secret_key)
        self.inbox = self._socket(zmq.ROUTER)
        curve_server(self.inbox, keys)
        port = self.inbox.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.out = self._socket(zmq.DEALER)
        curve_client(self.out, keys, curve_public_key(self.node_key))
        self.out.connect(self.node_address)
        self.decoder = Decoder(None)

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def close(self) -> None:
        self.inbox.close(linger=0)
        self.out.close(linger=0)

    # --- messages -------------------------------------------------------------

    def frames(
        self,
        kind: str,
        body: dict[str, Any],
        *,
        identity: Identity | None = None,
        sender: bytes | None = None,
        blob: Blob | None = None,
    ) -> list[bytes]:
        """A message signed by `identity` (default: ours), or with header `from` =
        `sender` and the any-message signature, as a small-order key would sign."""
        if sender is None:
            frames = encode(
                identity or self.identity,
                self.mesh_id,
                kind,
                time.time_ns(),
                0,
                body,
                instance=self.instance,
                blob=blob,
            )
            return [bytes(frame) for frame in frames]
        header = msgpack.packb(
            {
                "v": 3,
                "mesh": self.mesh_id,
                "kind": kind,
                "from": sender,
                "inst": self.instance,
                "seq": time.time_ns(),
                "round": 0,
                "body": body,
                "digest": frames_digest([]),
            }
        )
        return [msgpack.packb([header, ANY_MESSAGE_SIGNATURE])]

    def send(self, frames: list[bytes]) -> None:
        self.out.send_multipart(frames, copy=False)

    def hello(self, identity: Identity | None = None, address: str | None = None) -> list[bytes]:
        who = identity or self.identity
        body = {"name": f"s{who.id[:12]}", "addr": address if address is not None else self.address}
        return self.frames("hello", body, identity=identity)

    def receive(self, timeout: float) -> Iterator[Message]:
        """The authentic messages that reach our ROUTER within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self.inbox.poll(int(left * 1000)):
                return
            _, *frames = self.inbox.recv_multipart(copy=False)
            try:
                yield self.decoder.decode(frames)
            except Rejected:
                continue

    # --- the cases ----------------------------------------------------------

    def weak_keys(self) -> int:
        """Every small-order key in every place a key travels (WIRE.md 9: `weak_key`);
        returns the messages sent."""
        sent = 0
        blob_arrays = {"w": np.zeros(4, dtype=np.float32)}
        for key in small_order_keys():
            for kind, body in (
                ("status", {"addr": self.address}),
                ("hello", {"name": "weak", "addr": self.address}),
                ("heartbeat", {"name": "weak", "addr": self.address}),
            ):
                self.send(self.frames(kind, body, sender=key))
            entry = {"name": "weak", "addr": self.address, "key": key}
            self.send(self.frames("peers", {"peers": [entry]}))
            announce = {
                "id": bytes(32),
                "origin": key,
                "round": 1,
                "kind": "model",
                "digest": bytes(32),
                "size": 16,
            }
            self.send(self.frames("announce", announce))
            self.send(self.frames("blob", {}, blob=_blob_of(key, blob_arrays)))
            sent += 6
        return sent

    def unusable_addresses(self) -> int:
        """Hellos and heartbeats naming addresses no node can be dialled at."""
        for address in UNUSABLE_ADDRESSES:
            for kind in ("hello", "heartbeat"):
                body = {"name": f"bad{len(address)}", "addr": address}
                self.send(self.frames(kind, body, identity=Identity.generate()))
        return 2 * len(UNUSABLE_ADDRESSES)

    def unsolicited_peers(self, aimed_at: list[str]) -> None:
        """A peer list nobody asked for, naming addresses the node should greet."""
        entries = [
            {"name": f"aim{index}", "addr": address, "key": Identity.generate().public_key}
            for index, address in enumerate(aimed_at)
        ]
        self.send(self.hello())
        self.send(self.frames("peers", {"peers": entries}))

    def fresh_hellos(self, count: int) -> None:
        """`count` hellos, each from a fresh key, each naming an address nobody answers."""
        for address in unreachable_addresses(count):
            self.send(self.hello(Identity.generate(), address))

    def handshake_abuse(self, seconds: float) -> int:
        """Connections that fail their handshake, kept retrying for `seconds`: a client
        dialling the wrong server key, a plaintext client, and a client whose CURVE pair
        does not match. Returns how many sockets tried."""
        liar, other = Identity.generate(), Identity.generate()
        own = Encryption(liar.curve_public_key, liar.curve_secret_key)
        mismatched = Encryption(liar.curve_public_key, other.curve_secret_key)
        sockets = []
        for _ in range(3):
            wrong_server = self._socket(zmq.DEALER)
            curve_client(wrong_server, own, other.curve_public_key)
            plaintext = self._socket(zmq.DEALER)
            pair = self._socket(zmq.DEALER)
            curve_client(pair, mismatched, curve_public_key(self.node_key or b""))
            sockets += [wrong_server, plaintext, pair]
        for sock in sockets:
            sock.setsockopt(zmq.RECONNECT_IVL, 50)
            sock.connect(self.node_address)
            with contextlib.suppress(zmq.Again):  # refused already: nothing to queue on
                sock.send_multipart(self.hello(), zmq.NOBLOCK)
        # And the other way round: hellos that send the node to our address with keys
        # our ROUTER does not hold, so its own connections fail their handshake.
        for _ in range(3):
            self.send(self.hello(Identity.generate(), self.address))
        time.sleep(seconds)
        for sock in sockets:
            sock.close(linger=0)
        return len(sockets)

    def copied_model(self, timeout: float = 5.0) -> bool:
        """Say hello, fetch the node's latest announced blob and send it back, unasked,
        as a relay would: a valid model, copied. True when there was one to copy."""
        self.send(self.hello())
        offer = next((m for m in self.receive(timeout) if m.kind == "announce"), None)
        if offer is None:
            return False
        self.send(self.frames("fetch", {"id": offer.body["id"]}))
        blob = next((m.blob for m in self.receive(timeout) if m.kind == "blob"), None)
        if blob is None:
            return False
        self.send(self.frames("blob", {}, blob=blob))
        self.send(self.frames("announce", {**offer.body}))
        return True

    def large_bad_messages(self, count: int, size: int, wait: float = 0.0) -> None:
        """`count` messages of `size` bytes whose header signature is wrong, each over a
        connection of its own, all at once; waits up to `wait` seconds for them to leave."""
        frames = self.frames("blob", {}, blob=_blob_of(None, {"w": np.zeros(size // 4, "f4")}))
        header, _ = msgpack.unpackb(frames[0])
        bad = [msgpack.packb([header, bytes(64)]), *frames[1:]]
        keys = Encryption(self.identity.curve_public_key, self.identity.curve_secret_key)
        senders = []
        for _ in range(count):
            sender = self._socket(zmq.DEALER)
            curve_client(sender, keys, curve_public_key(self.node_key or b""))
            sender.connect(self.node_address)
            sender.send_multipart(bad, copy=False)
            senders.append(sender)
        for sender in senders:
            sender.close(linger=int(wait * 1000))


def _blob_of(origin: bytes | None, arrays: dict[str, np.ndarray]) -> Blob:
    """A blob signed by a fresh key, or claiming `origin` with the any-message signature."""
    blob = make_blob(Identity.generate(), 1, "model", arrays)
    if origin is None:
        return blob
    record = msgpack.packb(
        [origin, 1, "model", b"", blob.digest, [i.packed() for i in blob.index], {}]
    )
    return Blob(
        origin,
        1,
        "model",
        b"",
        blob.digest,
        blob.index,
        {},
        record,
        ANY_MESSAGE_SIGNATURE,
        blob.frames,
    )


# --- the soak -------------------------------------------------------------------


def process_figures(pids: list[int]) -> dict[str, int]:
    """Resident memory (MB) and open files of `pids` together, from /proc."""
    rss_kb = files = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            rss_kb += int(next(line for line in status if line.startswith("VmRSS")).split()[1])
            files += len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, StopIteration):
            continue
    return {"rss_mb": rss_kb // 1024, "open_files": files}


def node_processes(run: Path) -> list[int]:
    """The pids of the processes that run the nodes, from the run's processes.json."""
    try:
        return [entry["pid"] for entry in _listing(run)]
    except (OSError, ValueError):
        return []


def node_contacts(run: Path) -> dict[str, str]:
    """name -> KEY@ADDRESS of every node of the run that has started (its info.json)."""
    found = {}
    for info in sorted(run.glob("*/info.json")):
        facts = json.loads(info.read_text())
        found[facts["name"]] = f"{facts['public_key']}@{facts['listen']}"
    return found


CASES: list[tuple[str, Callable[[Stranger], Any]]] = [
    ("weak keys", Stranger.weak_keys),
    ("unusable addresses", Stranger.unusable_addresses),
    ("unsolicited peers", lambda s: s.unsolicited_peers(unreachable_addresses(20))),
    ("1000 fresh hellos", lambda s: s.fresh_hellos(1000)),
    ("handshake abuse", lambda s: s.handshake_abuse(10.0)),
    ("copied model", Stranger.copied_model),
    ("large bad messages", lambda s: s.large_bad_messages(4, 240 << 20)),
]


def soak(minutes: float, out: Path, attack: bool = True) -> int:
    """Attack every node of a 4-node launch for `minutes` (or, without `attack`, only ask
    their status: the baseline), then stop it; 0 when every node answered status
    throughout and all finished the same rounds, in order."""
    launch = _launch(out, 4)
    context = zmq.Context()
    silent: list[str] = []
    try:
        while len(node_contacts(out)) < 4 or not node_processes(out):
            time.sleep(1.0)
        time.sleep(5.0)  # past the first round
        contacts = node_contacts(out)
        mesh_id = _status_of(next(iter(contacts.values()))).mesh_id
        strangers = [Stranger(c, mesh_id, context) for c in contacts.values()]
        start = process_figures(node_processes(out))
        print(f"start: {start}", flush=True)
        deadline = time.monotonic() + minutes * 60
        cycles = 0
        while time.monotonic() < deadline:
            for name, case in CASES if attack else [("a minute", lambda _: time.sleep(60))]:
                for stranger in strangers[: len(strangers) if attack else 1]:
                    case(stranger)
                for node, address in contacts.items():
                    if _status_of(address) is None:
                        silent.append(f"{node} after {name}")
            cycles += 1
            print(f"cycle {cycles}: {process_figures(node_processes(out))}", flush=True)
        end = process_figures(node_processes(out))
        print(f"end after {cycles} cycles: {end}", flush=True)
    finally:
        os.killpg(launch.pid, 2)  # Ctrl-C: the launch stops its nodes
        launch.wait(timeout=120)
        context.destroy(linger=0)
    return _verdict(out, silent)


def flood(out: Path, hellos: int = 1000, seconds: float = 60.0) -> int:
    """Send `hellos` hellos from fresh keys naming unreachable addresses to node0 of a
    2-node launch, and print every 5 s its process's open files, its peer table and the
    size of its log; 0 when all three are back where they started by the end."""
    launch = _launch(out, 2, "--hosts", "2")
    context = zmq.Context()
    try:
        while "node0" not in node_contacts(out) or len(node_processes(out)) < 2:
            time.sleep(1.0)
        time.sleep(5.0)
        node0 = node_contacts(out)["node0"]
        pid = next(p["pid"] for p in _listing(out) if "node0" in p["nodes"])
        log = out / "node0" / "node.log"

        def sample() -> tuple[int, int, int]:
            answer = _status_of(node0)
            table = len(answer.status["peers"]) if answer else -1
            return process_figures([pid])["open_files"], table, log.stat().st_size

        before = sample()
        print(f"{'seconds':>7} {'open files':>10} {'peer table':>10} {'log bytes':>10}")
        print(f"{'before':>7} {before[0]:>10} {before[1]:>10} {before[2]:>10}", flush=True)
        Stranger(node0, _status_of(node0).mesh_id, context).fresh_hellos(hellos)
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < seconds:
            time.sleep(5.0)
            now = sample()
            print(f"{elapsed + 5:>7.0f} {now[0]:>10} {now[1]:>10} {now[2]:>10}", flush=True)
    finally:
        os.killpg(launch.pid, 2)
        launch.wait(timeout=120)
        context.destroy(linger=0)
    return 0 if now[0] <= before[0] + 2 and now[1] <= before[1] else 1


def _listing(run: Path) -> list[dict[str, Any]]:
    return json.loads((run / "processes.json").read_text())["processes"]


def _launch(out: Path, nodes: int, *flags: str) -> subprocess.Popen:
    """`meshfl launch` of `nodes` digits nodes, for more rounds than it will run: the
    caller stops it (Ctrl-C) when it has seen enough."""
    return subprocess.Popen(
        [sys.executable, "-m", "meshfl.launch.cli", "launch", "--nodes", str(nodes), *flags]
        + ["--rounds", "1000000", "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _status_of(contact: str) -> Any:
    return ask_status(Identity.generate(), contact, "127.0.0.1", 10.0)


def _verdict(out: Path, silent: list[str]) -> int:
    rounds = {}
    for metrics in sorted(out.glob("*/metrics.jsonl")):
        lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.endswith("}")]
        done = [line["round"] for line in lines]
        rounds[metrics.parent.name] = done
        if done != list(range(1, len(done) + 1)):
            print(f"{metrics.parent.name}: rounds out of order or missing", flush=True)
            return 1
    print(f"rounds finished: { {n: len(r) for n, r in rounds.items()} }", flush=True)
    print(f"status unanswered: {silent or 'never'}", flush=True)
    lagging = max(map(len, rounds.values())) - min(map(len, rounds.values()))
    tracebacks = [p.parent.name for p in out.glob("*/node.log") if "Traceback" in p.read_text()]
    print(f"tracebacks in: {tracebacks or 'no log'}", flush=True)
    return 0 if not silent and lagging <= 2 and not tracebacks and len(rounds) == 4 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    soak_parser = commands.add_parser("soak", help="attack a launched 4-node mesh for a while")
    soak_parser.add_argument("--minutes", type=float, default=30.0, help="default: 30")
    soak_parser.add_argument("--out", type=Path, required=True, help="the run folder")
    soak_parser.add_argument(
        "--no-attack", action="store_true", help="the baseline: the same mesh, left alone"
    )
    flood_parser = commands.add_parser(
        "flood", help="1000 hellos from fresh keys at node0 of a launch; what they cost it"
    )
    flood_parser.add_argument("--out", type=Path, required=True, help="the run folder")
    args = parser.parse_args(argv)
    if args.command == "flood":
        return flood(args.out)
    return soak(args.minutes, args.out, attack=not args.no_attack)


if __name__ == "__main__":
    sys.exit(main())
