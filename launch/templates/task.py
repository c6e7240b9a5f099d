"""A meshfl task: the model the mesh learns (`model()`) and each node's data
(`data(node)`). Every node runs this file; replace the two functions with your own.

    meshfl launch --task task.py                  # 4 nodes on this machine
    meshfl launch --config peers.yaml             # the peers that peers.yaml lists

This one runs as it is: a small network on scikit-learn's embedded digits (8x8
images of 0-9), each node taking its own slice. See docs/tasks.md for everything a
task may define.
"""

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

# The classifier module, by its name in model(): FedC²I, FedReMa and pFedSV with a
# shared body read it. Leave it out if your rules need none.
head = "classifier"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Flatten(), nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1)
        )
        self.classifier = nn.Linear(64, 10)  # 10 logits: the mesh's number of classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def model() -> nn.Module:
    """The mesh's model (meshfl seeds it: every node starts from the same weights)."""
    return Net()


def data(node):
    """This node's (train, val, test), as torch Datasets or (inputs, labels) arrays.

    `node.index` of `node.nodes` cuts a shared set here; a machine with files of its
    own reads them instead, from the folder its peer entry names: node.data["root"].
    """
    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(node.seed).permutation(len(labels))  # alike on all nodes
    mine = np.array_split(order, node.nodes)[node.index]
    x = (images[mine] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = labels[mine]
    val, test = int(0.6 * len(y)), int(0.8 * len(y))
    return (x[:val], y[:val]), (x[val:test], y[val:test]), (x[test:], y[test:])
