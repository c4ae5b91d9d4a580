"""F0 predictor of the HiFT vocoder (upstream ``ConvRNNF0Predictor``; despite the name it has no RNN)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

NUM_CONV_LAYERS = 5


class ConvF0Predictor(nn.Module):
    """Mel (B, in_channels, T) → F0 in Hz (B, T): 5 × [weight-normed Conv1d k3 → ELU], Linear, abs."""

    def __init__(self, in_channels: int, cond_channels: int, num_class: int = 1):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(NUM_CONV_LAYERS):
            layers.append(weight_norm(nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1)))
            layers.append(nn.ELU())
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        hidden = self.condnet(mel).transpose(1, 2)
        return self.classifier(hidden).squeeze(-1).abs()
