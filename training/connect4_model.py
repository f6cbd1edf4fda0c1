"""The Connect Four value/policy network (PyTorch), exported to ONNX for serving.

Contract (kept by ``train_connect4_value``'s export):
  input  ``board``          uint8   [N, 2, 6, 7]  plane 0 side to move, plane 1
                                                  opponent; row 0 = bottom
  output ``value``          float32 [N, 1]  tanh, +1 win / 0 draw / -1 loss for
                                            the side to move
  output ``policy_logits``  float32 [N, 7]  logits over columns 0..6 (not
                                            masked: the search masks full ones)

With ``wdl`` the value head ends in three logits (win, draw, loss for the side
to move; trained by cross-entropy on the solver's outcome, as Leela Chess Zero's
WDL head) and ``value`` = P(win) - P(loss), so the contract is the same.

Inside, two planes are added to the two stone planes: a constant plane of
ones (so zero padding tells the board's edge from an empty cell) and the
parity of the stone count (whether the side to move is the first player,
which decides who profits from odd and even threat rows in Connect Four).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

ROWS, COLS = 6, 7


class ResidualBlock(nn.Module):
    """Two 3x3 conv + batch-norm layers with a skip connection."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class Connect4Net(nn.Module):
    """Residual CNN: stem conv, ``blocks`` residual blocks, value and policy heads.

    ``forward(board)`` takes uint8 (or float) [N, 2, 6, 7] and returns
    ``(value [N, 1], policy_logits [N, 7])``, both float32; ``raw_heads`` gives
    the value head's own output (with ``wdl`` its logits [N, 3]) for training."""

    def __init__(self, channels: int = 40, blocks: int = 4, head_channels: int = 4,
                 value_hidden: int = 64, wdl: bool = False):
        super().__init__()
        self.config = dict(channels=channels, blocks=blocks, head_channels=head_channels,
                           value_hidden=value_hidden, wdl=wdl)
        self.stem = nn.Sequential(nn.Conv2d(4, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels), nn.ReLU())
        self.body = nn.Sequential(*[ResidualBlock(channels) for _ in range(blocks)])
        flat = head_channels * ROWS * COLS
        self.value_head = nn.Sequential(
            nn.Conv2d(channels, head_channels, 1, bias=False), nn.BatchNorm2d(head_channels),
            nn.ReLU(), nn.Flatten(), nn.Linear(flat, value_hidden), nn.ReLU(),
            *((nn.Linear(value_hidden, 3),) if wdl else (nn.Linear(value_hidden, 1), nn.Tanh())))
        self.policy_head = nn.Sequential(
            nn.Conv2d(channels, head_channels, 1, bias=False), nn.BatchNorm2d(head_channels),
            nn.ReLU(), nn.Flatten(), nn.Linear(flat, COLS))

    def raw_heads(self, board: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The heads' outputs before the value's WDL reduction: value float32
        [N, 1] (tanh), or with ``wdl`` its logits [N, 3] (win, draw, loss);
        policy_logits float32 [N, 7]."""
        x = board.to(torch.float32)
        ones = torch.ones_like(x[:, :1])
        stones = x.sum(dim=(1, 2, 3), keepdim=True)
        # parity 1 when an odd number of stones is down (second player to move)
        parity = ones * (stones - 2.0 * torch.floor(stones * 0.5))
        h = self.body(self.stem(torch.cat([x, ones, parity], dim=1)))
        return self.value_head(h), self.policy_head(h)

    def forward(self, board: torch.Tensor):
        v, logits = self.raw_heads(board)
        if self.config["wdl"]:  # P(win) - P(loss): one chain (softmax, product, sum), all in the FP32 head
            v = (torch.softmax(v, dim=1) * v.new_tensor([1.0, 0.0, -1.0])).sum(dim=1, keepdim=True)
        return v, logits


def parameter_count(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
