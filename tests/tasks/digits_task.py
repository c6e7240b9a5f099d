"""A task as a user would write it, with what built-in models lack: batch normalization,
dropout, a frozen layer and an integer buffer, its own batch size, loss and optimizer;
on scikit-learn's embedded digits, each node taking its own slice as a torch Dataset."""

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

head = "classifier"
batch_size = 30


def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels, label_smoothing=0.1)


def optimizer(parameters):
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.5)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(64, 64)
        self.frozen.requires_grad_(False)
        self.features = nn.Sequential(
            nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1)
        )
        self.classifier = nn.Linear(32, 10)
        self.register_buffer("batches_seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.batches_seen += 1
        return self.classifier(self.features(torch.relu(self.frozen(x.flatten(1)))))


def model() -> nn.Module:
    return Net()


def data(node):
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(node.seed).permutation(len(y))
    mine = np.array_split(order, node.nodes)[node.index][:150]
    x = torch.tensor(x[mine] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[mine])
    cut_val, cut_test = 90, 120
    return (
        TensorDataset(x[:cut_val], y[:cut_val]),
        TensorDataset(x[cut_val:cut_test], y[cut_val:cut_test]),
        (x[cut_test:].numpy(), y[cut_test:].numpy()),
    )
