"""3C1F: the three-convolution, one-hidden-layer network used for Fashion-MNIST.

Layer stack (shapes for a batch of N 28x28 images with ``in_chans`` channels)::

    input                     N x in_chans x 28 x 28
    Conv2d(in_chans,128,3,p=1) + ReLU   N x 128 x 28 x 28
    Conv2d(128,128,3,p=1)     + ReLU    N x 128 x 28 x 28
    Conv2d(128,128,3,p=1)     + ReLU    N x 128 x 28 x 28
    MaxPool2d(3)                        N x 128 x 9 x 9      (floor(28 / 3) = 9)
    Flatten                             N x 10368
    Linear(10368, 500)        + ReLU    N x 500
    Linear(500, num_classes)            N x num_classes

Parameter count at ``in_chans=1, num_classes=10``: 5,485,958.
PyTorch default initialisation is kept.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["C3F1"]


class C3F1(nn.Module):
    """Three 3x3 convolutions (128 channels), a 3x3 max-pool and a 500-unit hidden layer.

    Args:
        num_classes: size of the output layer.
        in_chans: number of input channels (1 for Fashion-MNIST).
        img_size: input height/width; the flattened feature size is
            ``128 * (img_size // 3) ** 2`` (10368 for the default 28).
        batch_norm: a BatchNorm2d after each convolution (zoo name ``3c1f-bn``).
    """

    def __init__(self, num_classes: int = 10, in_chans: int = 1, img_size: int = 28,
                 batch_norm: bool = False) -> None:
        super().__init__()
        pooled = img_size // 3
        layers: list[nn.Module] = []
        for c_in in (in_chans, 128, 128):
            layers.append(nn.Conv2d(c_in, 128, kernel_size=3, padding=1))
            if batch_norm:  # "3c1f-bn": a BatchNorm2d after each convolution
                layers.append(nn.BatchNorm2d(128))
            layers.append(nn.ReLU())
        self.features = nn.Sequential(*layers, nn.MaxPool2d(3))
        self.flatten = nn.Flatten()
        self.classifier = nn.Sequential(
            nn.Linear(128 * pooled * pooled, 500),
            nn.ReLU(),
            nn.Linear(500, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        """``x``: N x in_chans x img_size x img_size -> logits N x num_classes."""
        return self.classifier(self.flatten(self.features(x)))
