"""Per-layer expert load statistics: validation, uniform and zipf generators, files.

A load tensor is float64 ``[num_layers, num_logical]``: tokens routed to each logical
expert over some window (any non-negative unit; only ratios matter).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import torch

from ftengine.errors import ConfigError, PlacementError


def normalize_load(load: torch.Tensor | None, num_layers: int, num_logical: int) -> torch.Tensor:
    """Return ``load`` as a fresh CPU float64 ``[num_layers, num_logical]`` tensor.

    ``None`` means uniform load; a 1-D ``[num_logical]`` tensor applies to every layer.
    Raises ``PlacementError`` on a wrong shape, a negative or a non-finite value.
    """
    if load is None:
        return uniform_load(num_layers, num_logical)
    values = load.detach().to(device="cpu", dtype=torch.float64)
    if values.dim() == 1:
        values = values.unsqueeze(0).expand(num_layers, -1)
    if tuple(values.shape) != (num_layers, num_logical):
        raise PlacementError(
            f"expected expert load [{num_layers}, {num_logical}] (or [{num_logical}]), "
            f"got {tuple(load.shape)}"
        )
    bad = ~torch.isfinite(values) | (values < 0)
    if bool(bad.any()):
        layer, expert = (int(v) for v in bad.nonzero()[0])
        raise PlacementError(
            f"expert load must be finite and non-negative, but layer {layer}, expert {expert} "
            f"is {float(values[layer, expert])}"
        )
    return values.clone()


def uniform_load(num_layers: int, num_logical: int) -> torch.Tensor:
    """Every expert gets the same load (1.0)."""
    return torch.ones(num_layers, num_logical, dtype=torch.float64)


def zipf_load(
    num_layers: int,
    num_logical: int,
    *,
    exponent: float = 1.0,
    seed: int = 0,
    top_k: int = 8,
    tokens: int = 4096,
) -> torch.Tensor:
    """Token counts of a router with zipf-skewed expert popularity.

    In each layer the k-th most popular expert (an independent seeded permutation per
    layer) has weight ``1 / k**exponent``; each of ``tokens`` tokens picks ``top_k``
    distinct experts with probability proportional to those weights, as a top-k MoE
    router does (so no expert gets more than ``1 / top_k`` of the routed slots). With
    ``top_k = 1`` the counts follow the raw zipf shares.
    """
    if not 1 <= top_k <= num_logical:
        raise PlacementError(f"top_k must be in [1, {num_logical}], got {top_k}")
    generator = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, num_logical + 1, dtype=torch.float64) ** exponent
    load = torch.empty(num_layers, num_logical, dtype=torch.float64)
    for layer in range(num_layers):
        popularity = torch.empty_like(weights)
        popularity[torch.randperm(num_logical, generator=generator)] = weights
        picks = torch.multinomial(
            popularity.expand(tokens, -1), top_k, replacement=False, generator=generator
        )
        load[layer] = torch.bincount(picks.flatten(), minlength=num_logical).to(torch.float64)
    return load


def load_from_file(path: Path, num_layers: int, num_logical: int) -> torch.Tensor:
    """Read a load table from ``.json`` (nested lists), ``.npy`` or ``.pt`` (a tensor)."""
    if path.suffix not in (".json", ".npy", ".pt"):
        raise ConfigError(f"{path}: unknown load file type {path.suffix!r}; use .json, .npy or .pt")
    try:
        if path.suffix == ".json":
            loaded: object = torch.tensor(json.loads(path.read_text()), dtype=torch.float64)
        elif path.suffix == ".npy":
            loaded = torch.from_numpy(np.load(path, allow_pickle=False))
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError, TypeError, pickle.UnpicklingError) as exc:
        raise ConfigError(
            f"{path}: cannot read an expert load table ({exc}); expected {path.suffix} data "
            "holding a [layers, experts] table"
        ) from exc
    if not isinstance(loaded, torch.Tensor):
        raise ConfigError(f"{path}: expected a saved tensor, got {type(loaded).__name__}")
    return normalize_load(loaded.to(torch.float64), num_layers, num_logical)
