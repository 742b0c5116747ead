"""The learning-rate schedule, in optimizer steps (so a resumed run continues it exactly)."""

from __future__ import annotations

import math


class WarmupCosine:
    """lr factor for optimizer step s (0-based): linear warm-up, then cosine decay to 0 at `total`."""

    def __init__(self, warmup: int, total: int):
        self.warmup = warmup
        self.total = total

    def __call__(self, s: int) -> float:
        if s < self.warmup:
            return (s + 1) / (self.warmup + 1)
        progress = min(1.0, (s - self.warmup) / max(1, self.total - self.warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
