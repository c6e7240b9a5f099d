"""Flower's FedAvg job on scikit-learn's digits, as a meshfl task: the job of Flower's
simulation example that meshfl is measured against, cut the same way, so that the two
compare on accuracy as well as on time.

    meshfl launch --task examples/flower_digits_task.py --algorithm fedavg --nodes 16

Its exact model (64-64-10), optimizer (SGD, lr 0.05, no momentum) and batch size (32);
each node takes its shard of one seeded shuffle of the 1,797 images and splits it 80/20
into train and test, stratified where the shard allows, as Flower's clients do. Flower
keeps no validation split, so this task keeps none either: a rule that screens or
scores on validation data has nothing to judge with here and takes the peers as they
come (plain FedAvg does the same).
"""

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

batch_size = 32


def optimizer(parameters):
    return torch.optim.SGD(parameters, lr=0.05)


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def data(node):
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(y))
    mine = np.array_split(order, node.nodes)[node.index]
    stratify = y[mine] if len(mine) * 0.2 >= 10 else None  # a tiny shard cannot stratify
    x_train, x_test, y_train, y_test = train_test_split(
        x[mine], y[mine], test_size=0.2, random_state=0, stratify=stratify
    )
    no_val = (x_train[:0], y_train[:0])
    return (x_train, y_train), no_val, (x_test, y_test)
