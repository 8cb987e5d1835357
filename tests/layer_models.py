"""Small float64 models with every kind of layer K-FAC and the layer-wise kernels cover,
shared by tests/analyses/influence/test_kfac_layerwise.py and tests/analyses/ntk_distance/test_kernel_layerwise.py."""

from __future__ import annotations

import torch
from torch import nn

F64 = torch.float64


class AttentionNet(nn.Module):
    """4 tokens of width 8: a linear embedding, torch's nn.MultiheadAttention, a LayerNorm
    (tracked, not covered by K-FAC) and a linear head on the mean token; 3 outputs."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8, dtype=F64)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64)
        self.norm = nn.LayerNorm(8, dtype=F64)
        self.head = nn.Linear(8, 3, dtype=F64)

    def forward(self, x):
        h = torch.tanh(self.embed(x.reshape(x.shape[0], 4, 4)))
        h, _ = self.mha(h, h, h)
        return self.head(self.norm(h).mean(1))


class ConvNet(nn.Module):
    """A patch embedding, a padded convolution without bias and a linear head on 1x8x8 images."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(1, 3, 4, stride=4, dtype=F64)
        self.conv = nn.Conv2d(3, 2, 3, padding="same", bias=False, dtype=F64)
        self.head = nn.Linear(2 * 2 * 2, 3, dtype=F64)

    def forward(self, x):
        h = torch.tanh(self.patch(x.reshape(-1, 1, 8, 8)))
        return self.head(torch.tanh(self.conv(h)).flatten(1))
