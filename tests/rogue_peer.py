"""A mesh member that signs correctly and lies with its tensors, for
tests/hostile/test_hostile_peer.py.

    python tests/rogue_peer.py CONFIG NAME OUT

It is a real node of the mesh (the product's own Node, with its key, data and model)
whose blobs are mutated from its honest model, one mutation a round in a seeded random
order: as a gossip peer it publishes them as its models, as a client of a coordinator it
uploads them. It prints one JSON line a round: {"round", "mutation"}.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import msgpack
import numpy as np

from meshfl.launch.entry import named_node_options
from meshfl.node import config as cfgmod
from meshfl.node.coordinator import ClientNode, _RoundInFlight
from meshfl.node.runtime import Node, build_node
from meshfl.node.trainer import state_to_arrays
from meshfl.protocol import codecs
from meshfl.protocol.identity import Identity
from meshfl.protocol.wire import RECORD_CONTEXT, Blob, TensorInfo, frames_digest, make_blob

# Each mutation and the refusal reason an honest node must count it under; a shape of
# 100 dimensions (numpy holds 64) is already dropped by the decoder, as shape_mismatch.
MUTATIONS = {
    "one fewer": "layout",
    "one extra": "layout",
    "renamed": "layout",
    "flattened": "layout",
    "float64": "layout",
    "int8": "layout",
    "truncated": "layout",
    "reordered": "layout",
    "100 dimensions": "shape_mismatch",
    "nan": "not_finite",
    "huge n": "sample_count",
    # Lies in a codec's own fields (protocol/codecs.py), in an int8 blob.
    "nan scale": "codec",
    "scales of no tensor": "codec",
    "unknown codec": "codec",
}
CODEC_LIES = {lie for lie, reason in MUTATIONS.items() if reason == "codec"}


# The order of the lies is drawn at random once (seeded, so that a failure replays), and
# every lie is told once in its first len(MUTATIONS) rounds.
ORDER = random.Random(18).sample(list(MUTATIONS), len(MUTATIONS))


def mutation_of(round_no: int) -> str:
    return ORDER[(round_no - 1) % len(ORDER)]


def mutate(arrays: dict[str, np.ndarray], how: str) -> dict[str, np.ndarray]:
    """A copy of `arrays` that lies in one way about the schema (or holds a NaN)."""
    arrays = {name: array.copy() for name, array in arrays.items()}
    first, last = list(arrays)[0], list(arrays)[-1]
    if how == "one fewer":
        del arrays[last]
    elif how == "one extra":
        arrays["spare.weight"] = np.ones(4, dtype=np.float32)
    elif how == "renamed":
        arrays = {f"x.{name}": array for name, array in arrays.items()}
    elif how == "flattened":
        arrays[first] = arrays[first].reshape(-1)
    elif how in ("float64", "int8"):
        arrays[first] = arrays[first].astype(how)
    elif how == "truncated":
        arrays[last] = arrays[last][:-1]
    elif how == "reordered":
        arrays = dict(reversed(list(arrays.items())))
    elif how == "nan":
        arrays[first].reshape(-1)[0] = np.nan
    return arrays


def codec_lie(arrays: dict[str, np.ndarray], how: str) -> tuple[dict[str, np.ndarray], dict]:
    """`arrays` as an int8 blob would carry them, and its meta, lying in one field."""
    encoded, meta = codecs.encode(arrays, "int8")
    first = list(arrays)[0]
    if how == "nan scale":
        encoded[first + codecs.SCALES] = encoded[first + codecs.SCALES].copy()
        encoded[first + codecs.SCALES][0] = np.nan
    elif how == "scales of no tensor":
        encoded["spare" + codecs.SCALES] = np.ones(1, dtype=np.float32)
    elif how == "unknown codec":
        meta["codec"] = "zstd"
    return encoded, meta


def mutated_blob(node: Node, round_no: int, kind: str, how: str, meta: dict) -> Blob:
    arrays = mutate(state_to_arrays(node.model), how)
    meta = {**meta, "n": 2**63 if how == "huge n" else len(node.data.y_train)}
    if how in CODEC_LIES:
        arrays, named = codec_lie(arrays, how)
        meta.update(named)
    if how == "100 dimensions":
        last = list(arrays)[-1]
        return _claiming_shape(
            node.identity,
            round_no,
            kind,
            arrays,
            node.schema,
            meta,
            last,
            arrays[last].shape + (1,) * 99,
        )
    return make_blob(node.identity, round_no, kind, arrays, node.schema, meta)


def _claiming_shape(
    identity: Identity,
    round_no: int,
    kind: str,
    arrays: dict,
    schema: bytes,
    meta: dict,
    name: str,
    shape: tuple[int, ...],
) -> Blob:
    """A signed blob whose index claims `shape` for tensor `name` (numpy could not even
    hold it: at most 64 dimensions); its byte lengths stay consistent."""
    honest = make_blob(identity, round_no, kind, arrays, schema, meta)
    index = [
        TensorInfo(info.name, info.dtype, shape if info.name == name else info.shape, info.nbytes)
        for info in honest.index
    ]
    digest = frames_digest(honest.frames)
    record = msgpack.packb(
        [
            identity.public_key,
            round_no,
            kind,
            schema,
            digest,
            [info.packed() for info in index],
            meta,
        ]
    )
    return Blob(
        identity.public_key,
        round_no,
        kind,
        schema,
        digest,
        index,
        meta,
        record,
        identity.sign(RECORD_CONTEXT + record),
        honest.frames,
    )


def report(round_no: int) -> None:
    print(json.dumps({"round": round_no, "mutation": mutation_of(round_no)}), flush=True)


class RoguePeer(Node):
    """Publishes a mutated model each round and keeps pace with the mesh's announces."""

    def _round(self, round_no: int) -> None:
        self.endpoint.set_round(round_no)
        self.endpoint.publish(mutated_blob(self, round_no, "model", mutation_of(round_no), {}))
        alive = {peer.public_key for peer in self.endpoint.alive_peers()}
        self.exchange.collect(round_no, {"model"}, alive, time.monotonic() + self.cfg.round_timeout)
        report(round_no)


class RogueClient(ClientNode):
    """Uploads a mutated model for every round its coordinator hands it."""

    def _train_and_upload(self, round_no: int, coordinator: bytes) -> _RoundInFlight:
        self.endpoint.set_round(round_no)
        before = self.endpoint.stats()
        blob = mutated_blob(self, round_no, "upload", mutation_of(round_no), {"round": round_no})
        self.endpoint.send_blob(coordinator, "upload", blob)
        report(round_no)
        return _RoundInFlight(round_no, 0.0, {}, before)


def main(config: str, name: str, out: str) -> None:
    cfg = cfgmod.load_config(config)
    options = named_node_options(cfg, name, Path(out))  # exactly as `meshfl node` would
    build_node(options, RogueClient if cfg.coordinator else RoguePeer).run()


if __name__ == "__main__":
    main(*sys.argv[1:])
