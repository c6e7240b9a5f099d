"""What a node tells a node of another mesh about its own (a hello's `about`, WIRE.md
7.8), and the one line that names both meshes when two such nodes meet.

Two nodes are on one mesh only when they agree on the shared settings and the model's
tensor layout (node/mesh_identity.py); otherwise they drop each other's messages as
`wrong_mesh`. That is safe but mute: two copies of a task file that differ in one layer
would each train alone. The `about` says, in words, what went into the mesh id, so the
line can say which of them differ.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import PurePath

import torch

from meshfl.protocol.decoder import MAX_ABOUT_TEXT
from meshfl.protocol.parts import OtherMesh

from . import config as cfgmod
from .task import USER_PREFIX

# The fields of an `about`, in the order the line names them.
FIELDS = ("mesh", "algorithm", "task", "classes", "model", "layout")


def mesh_about(
    cfg: cfgmod.MeshConfig, model: torch.nn.Module, classes: int, schema: bytes
) -> dict[str, str | int]:
    """What this node's mesh is: its name, its rule, its task, its classes and its model
    (`schema`, the digest of its tensor layout)."""
    params = cfgmod.explicit_params(cfg.algorithm, cfg.rounds)
    algorithm = cfg.algorithm.name
    if params:
        algorithm += " " + json.dumps(params, sort_keys=True, separators=(",", ":"))
    task = PurePath(cfg.task).name if cfg.task else f"built-in model {cfg.model.name}"
    about: dict[str, str | int] = {
        "mesh": cfg.mesh,
        "algorithm": algorithm,
        "task": task,
        "classes": classes,
        "model": _model_words(model),
        "layout": schema.hex()[:16],
    }
    return {
        name: value[:MAX_ABOUT_TEXT] if isinstance(value, str) else value
        for name, value in about.items()
    }


def _model_words(model: torch.nn.Module) -> str:
    """'N tensors, V values: FIRST … LAST': the first and last weight matrices in the
    model's own order (its input layer and, mostly, its head), each with its shape, named
    as the user's module names them."""
    state = model.state_dict()
    values = sum(tensor.numel() for tensor in state.values())
    weights = [(name, p) for name, p in model.named_parameters() if p.dim() >= 2]
    weights = weights or list(model.named_parameters())
    ends = [weights[0], weights[-1]] if len(weights) > 1 else weights
    shapes = " … ".join(f"{name.removeprefix(USER_PREFIX)} {_shape(p.shape)}" for name, p in ends)
    return f"{len(state)} tensors, {values:,} values: {shapes}"


def _shape(shape: torch.Size) -> str:
    return "×".join(str(size) for size in shape) or "scalar"


def other_mesh_line(me: str, ours: Mapping[str, str | int], met: OtherMesh) -> str:
    """One line naming both meshes: each field where they differ, theirs and ours. The
    other side's words come from the network: printed only as plain, printable text."""
    differing = [field for field in FIELDS if field in ours and met.about.get(field) != ours[field]]
    if "model" in differing and "layout" in differing:  # the digest adds nothing to words
        differing.remove("layout")
    differences = [
        f"{field}: its {_printable(met.about.get(field, '?'))}, ours {_printable(ours[field])}"
        for field in differing
    ]
    what = "; ".join(differences) or (
        "it names no difference (compare the configs' mesh, algorithm and model; "
        "both nodes must run the same meshfl version)"
    )
    return (
        f"{me}: {met.name} at {met.address} runs another mesh, so neither learns from "
        f"the other: {what}"
    )


def _printable(value: object) -> str:
    return "".join(char if char.isprintable() else "?" for char in str(value))
