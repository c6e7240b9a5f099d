"""torchvision's ResNet-18 (batch normalization, 11.2 M parameters: a 45 MB blob) on
CIFAR-10 read from an ImageFolder root: a folder with one subfolder of images per class.

    meshfl launch --task examples/resnet18_cifar10_task.py --set data.root=DIR --nodes 4

Every node lists the same folder and takes its own slice of it (at most
SAMPLES_PER_NODE images, so that the example runs on a laptop's CPU in minutes); a LAN
machine gives its own folder in its peer entry instead (`data: {root: /data/mine}`).
"""

import numpy as np
import torch
from torch.utils.data import Subset
from torchvision import datasets, models, transforms

head = "fc"  # ResNet's classifier layer
batch_size = 32
SAMPLES_PER_NODE = 500
# CIFAR-10's per-channel mean and standard deviation
NORMALIZE = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))


def model() -> torch.nn.Module:
    return models.resnet18(num_classes=10)


def data(node):
    root = node.data["root"]
    if root is None:
        raise ValueError("give the ImageFolder root: --set data.root=DIR")
    images = datasets.ImageFolder(
        root, transform=transforms.Compose([transforms.ToTensor(), NORMALIZE])
    )
    order = np.random.default_rng(node.seed).permutation(len(images))  # alike on every node
    mine = np.array_split(order, node.nodes)[node.index][:SAMPLES_PER_NODE].tolist()
    val, test = int(0.6 * len(mine)), int(0.8 * len(mine))
    return Subset(images, mine[:val]), Subset(images, mine[val:test]), Subset(images, mine[test:])
