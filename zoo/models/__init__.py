"""Paper models: 3C1F (Fashion-MNIST) and the CIFAR WRN-28-4, DenseNet-BC-19, MobileNetV2;
and a small MLP-Mixer for 28×28 images."""

from .c3f1 import C3F1
from .densenet import DenseNetBC
from .mixer import MLPMixer
from .mobilenetv2 import MobileNetV2
from .wrn import WideResNet

__all__ = ["C3F1", "DenseNetBC", "MLPMixer", "MobileNetV2", "WideResNet"]
