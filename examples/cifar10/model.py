"""The CIFAR-10 CNN: conv blocks then a two-layer classifier, plain ops only so torch.fx traces it."""

from __future__ import annotations

from torch import Tensor, nn


class CifarCNN(nn.Module):
    """(B, 3, S, S) images -> (B, num_classes) logits. Each block halves S: two 3×3 convs, ReLU, max-pool."""

    def __init__(self, *, channels: tuple[int, ...] = (32, 64, 128), hidden: int = 256,
                 num_classes: int = 10, image_size: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for c in channels:
            layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.ReLU(),
                       nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
            c_in = c
        self.features = nn.Sequential(*layers)
        side = image_size // 2 ** len(channels)
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(c_in * side * side, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.features(x)  # (B, channels[-1], S / 2**blocks, S / 2**blocks)
        return self.classifier(h)  # (B, num_classes)
