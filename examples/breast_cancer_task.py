"""A meshfl task on tabular data: scikit-learn's breast-cancer set (embedded, so it runs
anywhere), split among the mesh's nodes, and a small network with batch normalization
and dropout.

    meshfl launch --task examples/breast_cancer_task.py --algorithm fedavg

Every node runs this file: `model()` gives the mesh's model, `data(node)` this node's
share, cut by its index among `node.nodes`, the same way on every machine.
"""

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer
from torch import nn

head = "classifier"  # the classifier layer, for the rules that read one (FedC²I, FedReMa)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Linear(30, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1)
        )
        self.classifier = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def model() -> nn.Module:
    return Net()


def data(node):
    """This node's share of the data, standardized, split 60/20/20 into train, val and
    test: a seeded shuffle that every node draws alike, then every node takes its own
    slice."""
    x, y = load_breast_cancer(return_X_y=True)
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    order = np.random.default_rng(node.seed).permutation(len(y))
    mine = np.array_split(order, node.nodes)[node.index]
    x, y = x[mine].astype(np.float32), y[mine]
    cut_val, cut_test = int(0.6 * len(y)), int(0.8 * len(y))
    return (
        (x[:cut_val], y[:cut_val]),
        (x[cut_val:cut_test], y[cut_val:cut_test]),
        (x[cut_test:], y[cut_test:]),
    )
