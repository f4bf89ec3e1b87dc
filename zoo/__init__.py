"""Paper models and datasets for tengrad_fx experiments.

``get_model(name, num_classes=10, in_chans=None, **kwargs)`` builds 3C1F, WRN-28-4,
DenseNet-BC-19, MobileNetV2 (CIFAR) or any ``timm:<name>`` / ``torchvision:<name>``
model; ``get_dataset(name, split, data_dir=None, download=False)`` loads Fashion-MNIST,
CIFAR-10 or CIFAR-100 into memory, and ``batches`` iterates over it.
"""

from .data import ArrayDataset, augment_batch, batches, get_dataset, num_batches, subset
from .registry import PARAM_COUNTS, get_model, model_names

__all__ = [
    "PARAM_COUNTS",
    "ArrayDataset",
    "augment_batch",
    "batches",
    "get_dataset",
    "get_model",
    "model_names",
    "num_batches",
    "subset",
]
