"""`meshfl bench wire`: what signing and verifying cost on the wire, against raw ZeroMQ.

What is measured, for each blob size, in one run:

signed
    A sender process streams blobs to a receiver process over loopback TCP, through a
    DEALER connected to a bound ROUTER (the socket pair the transport uses). For every
    blob the sender calls ``wire.make_blob`` (BLAKE3 over the tensor bytes and the
    origin's Ed25519 signature of the record), then ``wire.encode`` (the header and its
    signature), and sends the frames with ``copy=False``. The receiver takes each message
    off its socket, runs ``Decoder.decode`` on it (limits, msgpack, header schema, mesh,
    replay, both signatures, BLAKE3 of the frames, dtype/shape checks, model schema) and
    takes ``blob.arrays()``. The tensors come from a pool of random arrays allocated once,
    so no time goes to making data, but every blob is hashed and signed afresh.
encrypted
    The signed stream over ZeroMQ CURVE (WIRE.md 1.1), as a mesh sends by default: the
    ROUTER is a CURVE server, the DEALER a CURVE client, both with key pairs derived
    from Ed25519 identities. libzmq's I/O thread encrypts every frame on the sender and
    decrypts it on the receiver (XSalsa20-Poly1305, with a copy into and out of the box).
raw
    The same frames, from the same pool, over a pyzmq PUSH/PULL pair with the same socket
    options: no header, no hashing, no signatures.
curve
    The raw stream over CURVE: what encryption alone costs (``--detail`` shows it).

The two sides overlap their work the way ZeroMQ allows: ``send_multipart(copy=False)``
returns as soon as the message is queued, so the sender hashes blob i+1 while ZeroMQ's
I/O thread writes blob i to the socket; the receiver's I/O thread reads blob i+1 into
memory while the receiver's main thread verifies blob i (blake3 releases the GIL on
large buffers). A separate verifying thread on the receiver would add only a hand-off:
ZeroMQ's I/O thread already is the thread that receives ahead.

A throughput is the tensor bytes that arrived and were processed after a warm-up, over
the receiver's time from the end of the warm-up to the end of the last blob. MB means
2**20 bytes. Each figure is the median over the repetitions; the two paths alternate
within a repetition so that a noisy neighbour hurts both alike. ``--detail`` adds, per
path, the CPU milliseconds per MB of each process and of its main thread, and the
throughput the machine's cores would allow at that cost.

What bounds the ratio: the signed path must hash every byte twice (once on each side),
while raw loopback only moves it (about 0.4 CPU ms per MB for both sides together). With
SHA-256 (protocol version 1) hashing cost 0.6 to 0.9 CPU ms per MB per side, the signed
path was CPU-bound on two cores near 0.9 GB/s and the ratio stayed at 0.2 to 0.35. BLAKE3
costs about 0.2 ms per MB per side (``--detail`` shows it), so the signed path now needs
about 0.9 CPU ms per MB in all and reaches 0.55 to 0.75 of raw loopback on two cores
at 10 and 100 MB (about 0.4 at 1 MB, where the fixed cost per message weighs more).

What bounds the encrypted ratio: CURVE. libsodium's crypto_box alone costs about 0.8 CPU
ms per MB here, and libzmq adds buffer allocations and copies around it, so the curve
path spends about 1.3 to 1.9 ms per MB on each side, all of it on one I/O thread per
connection; the encrypted path adds the hashing of the signed one on the main threads.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np
import zmq

from meshfl.protocol import decoder as decoding
from meshfl.protocol import wire
from meshfl.protocol.identity import Identity
from meshfl.protocol.transport import Encryption, curve_client, curve_server

from .flags import add_repeats, add_sizes, bench_parser, positive

MIB = 1 << 20
WARMUP_MESSAGES = 2  # connection set-up, first-touch page faults, TCP window growth
MIN_TIMED_MESSAGES = 8
TENSORS_PER_BLOB = 4  # a blob is a few tensors, like a model's layers
POOL_BYTES = 64 * MIB  # at least this much distinct data per size, beyond the CPU caches
HWM = 4  # messages queued per socket; enough to keep both I/O threads busy
CHILD_TIMEOUT = 120.0  # seconds the parent waits for a child's answer before giving up
SCHEMA = hashlib.sha256(b"meshfl bench schema").digest()
PATHS = ("raw", "signed", "encrypted", "curve")
SIGNED_PATHS = ("signed", "encrypted")  # hashed, signed and verified per blob
CURVE_PATHS = ("encrypted", "curve")  # over ZeroMQ CURVE
COSTS = (
    "sender_ms_per_mb",
    "sender_main_ms_per_mb",
    "receiver_ms_per_mb",
    "receiver_main_ms_per_mb",
)


class BenchError(Exception):
    """A benchmark that could not run (a child process died or stalled); one line."""


def _cpu_seconds() -> tuple[float, float]:
    """CPU time of this process (all threads: ZeroMQ's I/O thread included) and of the
    calling thread alone (where the hashing, signing and verifying happen)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, time.thread_time()


def _costs(side: str, start: tuple[float, float], mb: float) -> dict[str, float]:
    """CPU milliseconds per MB since `start`: the whole process and its main thread."""
    total, main = (now - then for now, then in zip(_cpu_seconds(), start, strict=True))
    return {f"{side}_ms_per_mb": 1e3 * total / mb, f"{side}_main_ms_per_mb": 1e3 * main / mb}


def _pool(size: int) -> list[dict[str, np.ndarray]]:
    """Distinct random float32 tensors for blobs of `size` bytes, allocated once."""
    rng = np.random.default_rng(size)
    count = max(2, min(64, -(-POOL_BYTES // size)))
    floats = size // 4
    cuts = np.linspace(0, floats, TENSORS_PER_BLOB + 1).astype(int)
    pool = []
    for _ in range(count):
        flat = rng.standard_normal(floats, dtype=np.float32)
        pool.append(
            {f"layer{i}.weight": flat[cuts[i] : cuts[i + 1]] for i in range(TENSORS_PER_BLOB)}
        )
    return pool


def _socket(context: zmq.Context, kind: int) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    return sock


# --- the sender process -----------------------------------------------------------


def _keys(identity: Identity) -> Encryption:
    return Encryption(identity.curve_public_key, identity.curve_secret_key)


def _stream(
    sock: zmq.Socket,
    path: str,
    pool: list[dict[str, np.ndarray]],
    seconds: float,
    mesh_id: bytes,
    identity: Identity,
) -> dict[str, float]:
    instance = wire.new_instance()
    seq = time.time_ns()  # as a node does: rising across restarts
    start_cpu = _cpu_seconds()
    deadline = time.perf_counter() + seconds
    sent = 0
    while sent < WARMUP_MESSAGES + MIN_TIMED_MESSAGES or time.perf_counter() < deadline:
        arrays = pool[sent % len(pool)]
        if path in SIGNED_PATHS:
            blob = wire.make_blob(identity, sent, "model", arrays, schema=SCHEMA)
            seq += 1
            frames = wire.encode(
                identity, mesh_id, "blob", seq, sent, {}, instance=instance, blob=blob
            )
        else:
            frames = list(arrays.values())
        # Returns once queued: the I/O thread sends this blob while we hash the next.
        sock.send_multipart(frames, copy=False)
        sent += 1
    sock.send(b"")  # end of stream
    # The sender's CPU over its whole stream: what it costs to put these bytes out
    # (the last blobs may still be leaving; over a stream of many blobs that is noise).
    blob_mb = sum(array.nbytes for array in pool[0].values()) / MIB
    return {"sent": sent, **_costs("sender", start_cpu, sent * blob_mb)}


def _sender(conn: Connection) -> None:
    context = zmq.Context()
    pools: dict[int, list[dict[str, np.ndarray]]] = {}
    try:
        while (command := conn.recv()) is not None:
            path, size, port, server_key, seconds, mesh_id = command
            if size not in pools:
                pools.clear()  # one size at a time: bounded memory
                pools[size] = _pool(size)
            identity = Identity.generate()
            sock = _socket(context, zmq.DEALER if path in SIGNED_PATHS else zmq.PUSH)
            if path in CURVE_PATHS:
                curve_client(sock, _keys(identity), server_key)
            sock.connect(f"tcp://127.0.0.1:{port}")
            result = _stream(sock, path, pools[size], seconds, mesh_id, identity)
            sock.close(linger=-1)  # everything out before we report
            conn.send(result)
    finally:
        context.term()


# --- the receiver process ---------------------------------------------------------


def _drain(sock: zmq.Socket, path: str, size: int, mesh_id: bytes) -> dict[str, float]:
    decoder = decoding.Decoder(mesh_id, schema=SCHEMA)
    received = 0
    start_wall, start_cpu = 0.0, (0.0, 0.0)
    while True:
        frames = sock.recv_multipart(copy=False)
        if path in SIGNED_PATHS:
            frames = frames[1:]  # the ROUTER's routing id
        if len(frames) == 1 and len(frames[0]) == 0:
            break
        if path in SIGNED_PATHS:
            message = decoder.decode(frames)  # raises Rejected: a bench bug, not noise
            assert message.blob is not None
            got = sum(array.nbytes for array in message.blob.arrays().values())
        else:  # the same views of the received bytes that blob.arrays() gives
            # A zmq.Frame has the buffer protocol, which numpy's stubs do not know of.
            got = sum(np.frombuffer(frame, dtype="<f4").nbytes for frame in frames)  # type: ignore[call-overload]
        if got != size:
            raise BenchError(f"received {got} bytes of tensors, expected {size}")
        received += 1
        if received == WARMUP_MESSAGES:
            start_wall, start_cpu = time.perf_counter(), _cpu_seconds()
    wall = time.perf_counter() - start_wall
    timed_mb = (received - WARMUP_MESSAGES) * size / MIB
    return {
        "received": received,
        "mb_s": timed_mb / wall,
        **_costs("receiver", start_cpu, timed_mb),
    }


def _receiver(conn: Connection) -> None:
    context = zmq.Context()
    try:
        while (command := conn.recv()) is not None:
            path, size, mesh_id = command
            sock = _socket(context, zmq.ROUTER if path in SIGNED_PATHS else zmq.PULL)
            keys = _keys(Identity.generate())
            if path in CURVE_PATHS:
                curve_server(sock, keys)
            conn.send(
                {"port": sock.bind_to_random_port("tcp://127.0.0.1"), "server_key": keys.public_key}
            )
            try:
                conn.send(_drain(sock, path, size, mesh_id))
            except (wire.Rejected, BenchError) as err:
                conn.send({"error": f"receiver: {err}"})
            finally:
                sock.close(linger=0)
    finally:
        context.term()


# --- the parent ---------------------------------------------------------------------


class _Child:
    def __init__(self, context: Any, target: Any, name: str) -> None:
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=target, args=(child_conn,), name=name, daemon=True)
        self.process.start()
        child_conn.close()

    def ask(self, command: Any) -> None:
        self.conn.send(command)

    def answer(self) -> Any:
        return _answers([self])[0]

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        self.conn.close()


def _answers(children: list[_Child]) -> list[Any]:
    """One answer from each child, in whatever order they come; an error from either, or
    either dying, ends the wait at once (a sender must not wait on a dead receiver)."""
    answers: dict[int, Any] = {}
    while len(answers) < len(children):
        pending = [child.conn for n, child in enumerate(children) if n not in answers]
        ready = wait(pending, CHILD_TIMEOUT)
        if not ready:
            names = " and ".join(c.process.name for n, c in enumerate(children) if n not in answers)
            raise BenchError(f"{names}: no answer in {CHILD_TIMEOUT:.0f} s")
        for n, child in enumerate(children):
            if child.conn not in ready:
                continue
            try:
                answer = child.conn.recv()
            except EOFError:
                raise BenchError(
                    f"{child.process.name} died (exit code {child.process.exitcode})"
                ) from None
            if "error" in answer:
                raise BenchError(answer["error"])
            answers[n] = answer
    return [answers[n] for n in range(len(children))]


def _one_stream(
    sender: _Child, receiver: _Child, path: str, size: int, seconds: float
) -> dict[str, float]:
    mesh_id = os.urandom(wire.MESH_ID_BYTES)
    receiver.ask((path, size, mesh_id))
    listening = receiver.answer()
    sender.ask((path, size, listening["port"], listening["server_key"], seconds, mesh_id))
    sent, got = _answers([sender, receiver])
    if got["received"] != sent["sent"]:
        raise BenchError(f"{path}: sent {sent['sent']} blobs, {got['received']} arrived")
    return {**got, **sent}


def _blob_bytes(size_mb: float) -> int:
    """Whole float32 values, split evenly over the tensors of a blob."""
    unit = 4 * TENSORS_PER_BLOB
    return max(unit, int(size_mb * MIB) // unit * unit)


def bench_wire(
    sizes_mb: Sequence[float] = (1, 10, 100), seconds_per_size: float = 8.0, repeats: int = 3
) -> list[dict[str, Any]]:
    """Signed-blob (plain and encrypted) against raw ZeroMQ throughput per blob size; the
    module docstring says exactly what is measured. Each size gets `seconds_per_size` of
    timed streaming, split evenly over its len(PATHS) * `repeats` streams (each stream
    still carries at least MIN_TIMED_MESSAGES blobs after WARMUP_MESSAGES of warm-up).

    One dict per size: size_mb and `{path}_mb_s` for every path (medians, MB = 2**20
    bytes), ratio (signed_mb_s / raw_mb_s), encrypted_ratio (encrypted_mb_s / raw_mb_s),
    `{path}_runs` (every repetition), cores, and per
    path the CPU milliseconds per MB spent by the sender and the receiver process and by
    their main threads (`{path}_sender_ms_per_mb`, ...). Raises ValueError on bad
    arguments and BenchError when a child process fails.
    """
    if repeats < 1 or seconds_per_size <= 0 or not sizes_mb or min(sizes_mb) <= 0:
        raise ValueError("sizes, seconds and repeats must be positive")
    largest = wire.Limits().max_message_bytes - wire.Limits().max_envelope_bytes
    if max(_blob_bytes(size_mb) for size_mb in sizes_mb) > largest:
        raise ValueError(
            f"a blob may hold at most {largest / MIB:g} MB "
            "(wire.Limits.max_message_bytes, less the envelope)"
        )
    seconds = seconds_per_size / (len(PATHS) * repeats)
    cores = len(os.sched_getaffinity(0))
    context = multiprocessing.get_context("spawn")
    receiver = _Child(context, _receiver, "bench receiver")
    sender = _Child(context, _sender, "bench sender")
    results: list[dict[str, Any]] = []
    try:
        for size_mb in sizes_mb:
            size = _blob_bytes(size_mb)
            runs: dict[str, list[dict[str, float]]] = {path: [] for path in PATHS}
            for repeat in range(repeats):
                order = PATHS if repeat % 2 == 0 else PATHS[::-1]
                for path in order:
                    runs[path].append(_one_stream(sender, receiver, path, size, seconds))
            speed = {path: statistics.median(run["mb_s"] for run in runs[path]) for path in PATHS}
            results.append(
                {
                    "size_mb": size_mb,
                    **{f"{path}_mb_s": speed[path] for path in PATHS},
                    "ratio": speed["signed"] / speed["raw"],
                    "encrypted_ratio": speed["encrypted"] / speed["raw"],
                    **{f"{path}_runs": [run["mb_s"] for run in runs[path]] for path in PATHS},
                    **{
                        f"{path}_{cost}": statistics.median(run[cost] for run in runs[path])
                        for path in PATHS
                        for cost in COSTS
                    },
                    "cores": cores,
                }
            )
    finally:
        sender.stop()
        receiver.stop()
    return results


def _detail(row: dict[str, Any]) -> list[str]:
    """Where the CPU goes, per path: enough to tell a CPU-bound path from a waiting one."""
    lines = []
    for path in PATHS:
        runs = " ".join(f"{x:.0f}" for x in row[f"{path}_runs"])
        sender, sender_main, receiver, receiver_main = (row[f"{path}_{cost}"] for cost in COSTS)
        ceiling = 1e3 * row["cores"] / (sender + receiver)
        lines.append(
            f"  {path:9s} runs {runs} MB/s | CPU ms per MB: sender {sender:.2f} (main thread "
            f"{sender_main:.2f}), receiver {receiver:.2f} (main thread {receiver_main:.2f}) | "
            f"{row['cores']} cores allow at most {ceiling:.0f} MB/s"
        )
    return lines


def main(argv: list[str]) -> int:
    parser = bench_parser(
        "wire",
        "Throughput of signed blobs (sign, send, verify), plain and over "
        "ZeroMQ CURVE, against raw ZeroMQ PUSH/PULL of the same bytes, between "
        "two processes over loopback TCP.",
    )
    add_sizes(parser, float, [1.0, 10.0, 100.0], "blob sizes in MB (2**20 bytes)")
    add_repeats(parser, 3, "repetitions per size; the median is reported (default: 3)")
    parser.add_argument(
        "--seconds",
        type=positive(float),
        default=8.0,
        help="seconds of timed streaming per size, shared by the repetitions "
        "of both paths (default: 8)",
    )
    parser.add_argument(
        "--detail",
        action="store_true",
        help="also print every repetition and where the CPU time went",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        results = bench_wire(args.sizes, args.seconds, args.repeats)
    except (BenchError, ValueError) as err:
        print(f"meshfl bench wire: {err}", file=sys.stderr)
        return 1
    for row in results:
        print(
            f"size_mb={row['size_mb']:g} signed_mb_s={row['signed_mb_s']:.1f} "
            f"encrypted_mb_s={row['encrypted_mb_s']:.1f} raw_mb_s={row['raw_mb_s']:.1f} "
            f"ratio={row['ratio']:.2f} encrypted_ratio={row['encrypted_ratio']:.2f}",
            flush=True,
        )
        if args.detail:
            for line in _detail(row):
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
