"""`meshfl bench codecs`: a big model between two nodes under each codec, against none.

Two endpoints in one process, joined over loopback TCP with CURVE on (as a mesh runs by
default). For each codec, alternating within each repetition so that a noisy neighbour
hurts all alike, the sending node encodes a model's float32 tensors (protocol/codecs.py),
signs them as a blob (BLAKE3 over the bytes as they travel, Ed25519 over the record) and
publishes it; the other node is told by the announce, fetches the blob, verifies it in
its endpoint and holds it; then it decodes the tensors back to float32 as a node does
before any rule sees them (node/blobs.py). Reported per codec, medians over the
repetitions:

    MB          the tensors as they travel (MB = 2**20 bytes)
    held s      from the start of encoding to the blob held by the receiver, decoding
                after it included: what a round waits for one model
    encode, sign, verify, decode s
                each step alone; `verify` is the receiver's check of one message of
                that blob (Decoder.decode: both signatures, BLAKE3 of the frames,
                index), timed apart from the endpoint's own, which runs in its thread
    codec MB/s  float32 MB over encode + decode seconds: what one core turns through

A top-k delta needs the base both sides hold, so `topk` is measured apart, codec alone:
the model's state against a copy of it changed by noise, encoded and applied to a base
held under its name, each side naming the copy the delta makes (WIRE.md 9.3), medians
over as many repetitions.

The model is ResNet-18's state (torchvision, 10 classes: 44.7 MB of float32) unless
--model names another of node/models.py's or torchvision's.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from typing import Any

import numpy as np

from meshfl.node.blobs import decoded_arrays
from meshfl.node.deltas import TOPK_FRACTION
from meshfl.node.trainer import state_to_arrays
from meshfl.protocol import codecs
from meshfl.protocol.decoder import Decoder
from meshfl.protocol.endpoint import Endpoint, EndpointSettings
from meshfl.protocol.identity import Identity
from meshfl.protocol.ports import free_ports
from meshfl.protocol.wire import encode, make_blob, new_instance

from .flags import bench_parser, positive

MESH = hashlib.sha256(b"meshfl bench codecs").digest()[:16]
WAIT = 120.0
STEPS = ("held", "encode", "sign", "verify", "decode")


def model_arrays(name: str) -> dict[str, np.ndarray]:
    """The float32 state of ResNet-18 (or torchvision's model `name`) as it travels."""
    import torchvision

    return state_to_arrays(getattr(torchvision.models, name)(num_classes=10))


def endpoint(name: str) -> Endpoint:
    listen = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    return Endpoint(Identity.generate(), MESH, EndpointSettings(name, listen))


def send_once(
    sender: Endpoint, receiver: Endpoint, arrays: dict[str, np.ndarray], codec: str, round_no: int
) -> tuple[int, dict[str, float]]:
    """One blob of `arrays` under `codec`, sender to receiver: its bytes and each step's
    seconds."""
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    encoded, named = codecs.encode(arrays, codec)
    seconds["encode"] = time.perf_counter() - start
    clock = time.perf_counter()
    blob = make_blob(sender.identity, round_no, "model", encoded, b"", {"n": 1, **named})
    seconds["sign"] = time.perf_counter() - clock
    sender.set_round(round_no)
    receiver.set_round(round_no)
    sender.publish(blob)
    origin = {sender.identity.public_key}
    offers = receiver.wait_offers(round_no, {"model"}, origin, time.monotonic() + WAIT)
    receiver.fetch(offers)
    held = receiver.wait_blobs([blob.id], time.monotonic() + WAIT)
    if blob.id not in held:
        raise RuntimeError(f"the {codec} blob did not arrive within {WAIT:g} s")
    clock = time.perf_counter()
    decoded_arrays(held[blob.id])
    seconds["decode"] = time.perf_counter() - clock
    seconds["held"] = time.perf_counter() - start
    seconds["verify"] = verify_seconds(sender, blob)
    return blob.size, seconds


def verify_seconds(sender: Endpoint, blob: Any) -> float:
    """What the receiver's decoder spends on one `blob` message of `sender`'s."""
    frames = encode(
        sender.identity, MESH, "blob", 1, blob.round, {}, instance=new_instance(), blob=blob
    )
    decoder = Decoder(MESH)
    clock = time.perf_counter()
    decoder.decode([bytes(frames[0]), *frames[1:]])
    return time.perf_counter() - clock


def main(argv: list[str]) -> int:
    parser = bench_parser("codecs", __doc__, preformatted=True)
    parser.add_argument(
        "--repeats", type=positive(int), default=3, help="blobs per codec (default: 3)"
    )
    parser.add_argument(
        "--model", default="resnet18", help="a torchvision model (default: resnet18)"
    )
    args = parser.parse_args(argv)
    arrays = model_arrays(args.model)
    float_mb = sum(a.nbytes for a in arrays.values() if a.dtype == np.float32) / 2**20
    sender, receiver = endpoint("sender"), endpoint("receiver")
    try:
        sender.start()
        receiver.start([sender.contact])
        if not receiver.wait_joined(WAIT):
            raise RuntimeError("the two endpoints did not join")
        sender.wait_for_peers(1, WAIT)
        sizes: dict[str, int] = {}
        steps: dict[str, dict[str, list[float]]] = {
            codec: {step: [] for step in STEPS} for codec in codecs.CODECS
        }
        round_no = 0
        for _ in range(args.repeats):
            for codec in codecs.CODECS:
                round_no += 1
                sizes[codec], seconds = send_once(sender, receiver, arrays, codec, round_no)
                for step, value in seconds.items():
                    steps[codec][step].append(value)
    finally:
        receiver.close()
        sender.close()
    print(f"{args.model}: {float_mb:.1f} MB of float32; medians of {args.repeats} blobs a codec")
    print(
        f"{'codec':<6} {'MB':>6} {'x none':>6} {'held s':>7} {'x none':>6} {'encode':>7} "
        f"{'sign':>6} {'verify':>6} {'decode':>7} {'codec MB/s':>10}"
    )
    median = {c: {s: statistics.median(v) for s, v in steps[c].items()} for c in codecs.CODECS}
    for codec in codecs.CODECS:
        m = median[codec]
        rate = float_mb / (m["encode"] + m["decode"]) if codec != "none" else float("inf")
        print(
            f"{codec:<6} {sizes[codec] / 2**20:>6.1f} {sizes[codec] / sizes['none']:>6.2f} "
            f"{m['held']:>7.3f} {m['held'] / median['none']['held']:>6.2f} {m['encode']:>7.3f} "
            f"{m['sign']:>6.3f} {m['verify']:>6.3f} {m['decode']:>7.3f} {rate:>10.0f}"
        )
    delta_mb, encode_s, apply_s = delta_seconds(arrays, args.repeats)
    print(
        f"{'topk':<6} {delta_mb:>6.1f} {delta_mb / (sizes['none'] / 2**20):>6.2f} "
        f"{'':>7} {'':>6} {encode_s:>7.3f} {'':>6} {'':>6} {apply_s:>7.3f} "
        f"{float_mb / (encode_s + apply_s):>10.0f}  (codec alone: encode, then apply)"
    )
    return 0


def delta_seconds(arrays: dict[str, np.ndarray], repeats: int) -> tuple[float, float, float]:
    """MB of a top-k delta of `arrays` against a noisy copy, and the median seconds to
    encode it and to apply it to a base held under its name, each side naming the copy
    the delta makes (node/deltas.py)."""
    noise = np.random.default_rng(0)
    base = {
        name: array + (0.01 * noise.standard_normal(array.shape)).astype(array.dtype)
        if array.dtype == np.float32
        else array
        for name, array in arrays.items()
    }
    base_named = codecs.base_digest(base)
    encodes, applies, size = [], [], 0
    for _ in range(repeats):
        clock = time.perf_counter()
        delta, meta = codecs.encode_delta(arrays, base, TOPK_FRACTION, base_named)
        codecs.delta_copy_name(base_named, delta)
        encodes.append(time.perf_counter() - clock)
        clock = time.perf_counter()
        codecs.apply_delta(delta, meta, base, base_named)
        codecs.delta_copy_name(base_named, delta)
        applies.append(time.perf_counter() - clock)
        size = sum(array.nbytes for array in delta.values())
    return size / 2**20, statistics.median(encodes), statistics.median(applies)
