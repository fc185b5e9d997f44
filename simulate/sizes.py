"""Delta sizes from the real codec: encode a delta at a given density (the fraction of
bf16 weights a step changes) on a sample tensor and scale its bytes per parameter to the
model's size."""

from __future__ import annotations

import numpy as np

__all__ = ["bytes_per_param"]


def bytes_per_param(density: float, *, sample: int = 1 << 22, seed: int = 0) -> float:
    """Bytes per parameter of a delta (fleetrl's codec) in which a `density` fraction of
    `sample` bf16 weights changed by one or two units in the last place (what an
    optimizer step at a small learning rate does to most of the weights it moves)."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    import torch

    from fleetrl.actors.weights import codec
    from fleetrl.actors.weights.version import Layout, chunk_hashes, digest_of, specs_of

    rng = np.random.default_rng(seed)
    old = torch.from_numpy((rng.standard_normal(sample) * 0.02).astype(np.float32)).to(torch.bfloat16)
    bits = old.view(torch.int16).numpy().copy()
    changed = rng.random(sample) < density
    step = rng.choice(np.array([-2, -1, 1, 2], dtype=np.int16), size=int(changed.sum()))
    bits[changed] += step
    new = torch.from_numpy(bits).view(torch.bfloat16)
    layout = Layout(specs_of({"w": old}))
    o, w = [old.view(torch.int16).numpy().view(np.uint16)], [new.view(torch.int16).numpy().view(np.uint16)]
    blob = codec.encode(layout, o, w, run="simulate", base_version=0, base_digest=digest_of(chunk_hashes(layout, o)),
                        target_version=1, target_hashes=chunk_hashes(layout, w))
    return len(blob) / sample
