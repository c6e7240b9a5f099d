"""Which mesh a node belongs to: the id every peer derives alike from the settings they
must share and from the model's tensor layout. Peers whose ids differ drop each other's
messages as another mesh's (node/about.py says why in one line)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import msgpack
import torch

from .config import MeshConfig, explicit_params
from .models import model_schema


def model_digest(model: torch.nn.Module) -> bytes:
    """The digest of a model's tensor layout (names, dtypes, shapes): blobs name it, and
    it is part of the mesh id."""
    schema = model_schema(model)
    return hashlib.sha256(msgpack.packb([list(item) for item in schema])).digest()


def mesh_id(cfg: MeshConfig, schema: bytes) -> bytes:
    """16 bytes every peer derives alike from the settings they must share."""
    settings = json.dumps(shared_settings(cfg), sort_keys=True).encode()
    return hashlib.sha256(settings + schema).digest()[:16]


def shared_settings(cfg: MeshConfig) -> dict[str, Any]:
    """The settings every peer of a mesh must agree on; the node hashes them, with the
    model schema, into the mesh id, so peers that disagree never exchange blobs.

    In: the mesh name (two meshes may share a LAN), the algorithm and its parameters
    with defaults filled in (so `gamma: 5` and a default of 5 agree) and fitted to
    `rounds` (pFedLIA's warm-up: peers on another schedule would wait for blobs never
    sent), and the model with its head split (what a blob's tensors mean). Out, because
    peers may differ in them without misreading each other's blobs: rounds itself, where
    the fitted parameters agree (a peer that stops early just leaves),
    local training (personalization allows it), data (each peer has its own), timeouts
    (judged on the receiver's clock), the peer table (members join and leave) and
    whether a node's screening runs trials (what a node adopts is its own affair).
    """
    from meshfl.algorithms import TRIALS_KEY

    params = explicit_params(cfg.algorithm, cfg.rounds)
    return {
        "mesh": cfg.mesh,
        "algorithm": {
            "name": cfg.algorithm.name,
            "params": {key: value for key, value in params.items() if key != TRIALS_KEY},
        },
        # A task's model is known by its tensor layout (the schema beside these
        # settings), not by where its file lies on each machine.
        "model": "task" if cfg.task else {"name": cfg.model.name, "head": cfg.model.head},
    }
