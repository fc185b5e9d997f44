"""Shared helpers: a small model trained by a real fp32-master AdamW loop."""

import pytest
import torch


class TinyTrainer:
    """An fp32 master updated by AdamW (written out: torch.optim's first step pulls in
    seconds of lazy imports) with noisy gradients; publishes bf16 copies."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], lr: float = 1e-3, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.lr, self.t = lr, 0
        self.master = {n: torch.randn(s, generator=self.gen) * 0.05 for n, s in shapes.items()}
        self.m = {n: torch.zeros_like(p) for n, p in self.master.items()}
        self.v = {n: torch.zeros_like(p) for n, p in self.master.items()}

    def step(self, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, wd: float = 0.01) -> None:
        self.t += 1
        for n, p in self.master.items():
            g = torch.randn(p.shape, generator=self.gen) * 0.1 + 0.02 * p
            self.m[n].mul_(b1).add_(g, alpha=1 - b1)
            self.v[n].mul_(b2).addcmul_(g, g, value=1 - b2)
            mhat = self.m[n] / (1 - b1**self.t)
            vhat = self.v[n] / (1 - b2**self.t)
            p.mul_(1 - self.lr * wd).sub_(self.lr * mhat / (vhat.sqrt() + eps))

    def bf16(self) -> dict[str, torch.Tensor]:
        return {n: p.to(torch.bfloat16).contiguous() for n, p in self.master.items()}


SHAPES = {"embed": (300, 64), "ln": (64,), "attn": (64, 192), "mlp": (257, 130), "bias": (7,)}


@pytest.fixture
def make_trainer():
    """A factory: ``make_trainer(lr=...)`` -> a fresh TinyTrainer on SHAPES."""
    return lambda lr=1e-5, seed=0: TinyTrainer(SHAPES, lr=lr, seed=seed)

