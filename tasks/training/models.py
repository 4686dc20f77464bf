"""Built-in models, chosen by import path: gpuflow.tasks.training.models:small_cnn / :tiny_lm.

Each factory takes keyword arguments (the job's model_args) and returns an nn.Module.
Modules that support activation checkpointing expose set_activation_checkpointing().
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class SmallCNN(nn.Module):
    """A small image classifier: three conv blocks, global pooling, a linear head."""

    gpuflow_task = "classify"

    def __init__(self, num_classes: int = 10, width: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(
                    nn.Conv2d(c_in, c_out, 3, padding=1),
                    nn.BatchNorm2d(c_out),
                    nn.ReLU(),
                    nn.MaxPool2d(2),
                )
                for c_in, c_out in [(3, width), (width, width * 2), (width * 2, width * 4)]
            ]
        )
        self.head = nn.Linear(width * 4, num_classes)
        self.checkpointing = False

    def set_activation_checkpointing(self, enabled: bool) -> None:
        self.checkpointing = enabled

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images
        for block in self.blocks:
            x = (
                checkpoint(block, x, use_reentrant=False)
                if self.checkpointing and self.training
                else block(x)
            )
        return self.head(x.mean(dim=(2, 3)))


class TinyLM(nn.Module):
    """A small byte-level transformer language model (vocabulary 256)."""

    gpuflow_task = "lm"

    def __init__(
        self, d_model: int = 128, layers: int = 2, heads: int = 4, seq_len: int = 128
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, d_model)
        self.position = nn.Parameter(torch.zeros(1, seq_len, d_model))
        self.layers = nn.ModuleList(
            [
                nn.TransformerEncoderLayer(
                    d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
                )
                for _ in range(layers)
            ]
        )
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, 256)
        self.checkpointing = False

    def set_activation_checkpointing(self, enabled: bool) -> None:
        self.checkpointing = enabled

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position[:, :length]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        for layer in self.layers:
            if self.checkpointing and self.training:
                x = checkpoint(layer, x, mask, None, True, use_reentrant=False)
            else:
                x = layer(x, src_mask=mask, is_causal=True)
        return self.out(self.norm(x))


def small_cnn(**kwargs) -> nn.Module:
    return SmallCNN(**kwargs)


def tiny_lm(**kwargs) -> nn.Module:
    return TinyLM(**kwargs)
