"""A LAN machine's own images: every node trains on all of the image folder its peer
entry names (one subfolder per class, as torchvision's ImageFolder reads it), with a
small convolutional network. The class names are fixed here, so that machines whose
folders lack a class still agree on the model's outputs.

    # peers.yaml: each machine's peer names its own folder
    task: own_images_task.py
    peers:
      - {name: alpha, listen: "tcp://192.168.1.10:7700", data: {root: /data/images}}
      - {name: beta,  listen: "tcp://192.168.1.11:7700", data: {root: /data/images}}

    meshfl node --config peers.yaml --name alpha        # on alpha; beta on beta

Images of any size are resized to 32×32 RGB; each folder is split 70/15/15 into train,
validation and test by a seeded shuffle.
"""

from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Subset
from torchvision import datasets, transforms

# The mesh's classes, in the order of the model's outputs: change them to yours.
CLASSES = [
    "airplane", "automobile", "bird", "cat", "deer",
    "dog", "frog", "horse", "ship", "truck",
]  # fmt: skip
head = "classifier"


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
        )  # fmt: skip
        self.classifier = nn.Linear(32 * 8 * 8, len(CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def model() -> nn.Module:
    return SmallCNN()


class OwnFolder(datasets.ImageFolder):
    """An ImageFolder whose labels are the mesh's (CLASSES), not the order of the
    subfolders this machine happens to have; a subfolder of no known class is refused."""

    def find_classes(self, directory):
        present = sorted(entry.name for entry in Path(directory).iterdir() if entry.is_dir())
        unknown = sorted(set(present) - set(CLASSES))
        if unknown:
            raise ValueError(f"{directory}: folders of no class in CLASSES: {unknown}")
        return present, {name: CLASSES.index(name) for name in present}


def data(node):
    root = node.data["root"]
    if root is None:
        raise ValueError(f"peer {node.name}: give its image folder, data: {{root: DIR}}")
    to_tensor = transforms.Compose(
        [transforms.Resize((32, 32)), transforms.ToTensor(), transforms.Normalize(0.5, 0.5)]
    )
    images = OwnFolder(root, transform=to_tensor)  # (it opens every image as RGB)
    order = np.random.default_rng(node.seed).permutation(len(images)).tolist()
    val, test = int(0.7 * len(order)), int(0.85 * len(order))
    return (
        Subset(images, order[:val]),
        Subset(images, order[val:test]),
        Subset(images, order[test:]),
    )
