"""Index of a sharded HF safetensors checkpoint: which file holds each tensor, and its layout.

Built from ``model.safetensors.index.json`` (or a scan of every ``*.safetensors`` header),
``config.json`` and, for W8A8-dynamic checkpoints, ``quant_model_description.json``.
Expert tensors are looked up by (layer, expert, projection, param); both the split
``gate_proj`` / ``up_proj`` and the fused ``gate_up_proj`` naming are understood.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import torch
from safetensors import safe_open

from ftengine.errors import WeightLoadError
from ftengine.weights.safetensors_header import (
    DTYPES,
    READ_ERRORS,
    FileHeader,
    TensorInfo,
    read_header,
)

Quant = Literal["none", "w8a8_dynamic"]
Projection = Literal["gate_proj", "up_proj", "down_proj", "gate_up_proj"]
Param = Literal["weight", "weight_scale", "weight_offset"]
ExpertKey = tuple[int, int, str, str]
"""(layer, expert, projection, param)."""

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
QUANT_DESCRIPTION_NAME = "quant_model_description.json"

_EXPERT_RE = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|gate_up_proj)\.(weight|weight_scale|weight_offset)$"
)


def expert_tensor_name(layer: int, expert: int, projection: str, param: str = "weight") -> str:
    """The HF name of one expert tensor, e.g. ``model.layers.0.mlp.experts.3.up_proj.weight``."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}.{param}"


def _load_json(file: Path) -> dict[str, Any]:
    """A JSON object from ``file``; WeightLoadError if unreadable or not an object."""
    try:
        loaded = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightLoadError(f"{file}: cannot read JSON ({exc}); re-create it") from exc
    if not isinstance(loaded, dict):
        raise WeightLoadError(
            f"{file}: expected a JSON object, found {type(loaded).__name__}; re-create it"
        )
    return loaded


def _weight_map(root: Path) -> dict[str, Path]:
    """tensor name -> file, from the index json or, without one, from every shard's header."""
    index_file = root / INDEX_NAME
    if index_file.exists():
        raw = _load_json(index_file).get("weight_map")
        if not isinstance(raw, dict):
            raise WeightLoadError(
                f"{index_file}: expected a 'weight_map' object of tensor name -> file, found "
                f"{type(raw).__name__}; re-create the index"
            )
        return {str(name): root / str(file) for name, file in raw.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(
            f"{root}: neither {INDEX_NAME} nor any *.safetensors file; pass a checkpoint directory"
        )
    weight_map: dict[str, Path] = {}
    for file in files:
        for name in read_header(file).tensors:
            if name in weight_map:
                raise WeightLoadError(
                    f"{root}: tensor {name!r} is in both {weight_map[name].name} and "
                    f"{file.name}; remove the stale shard"
                )
            weight_map[name] = file
    return weight_map


def detect_quant(root: Path) -> Quant:
    """ "w8a8_dynamic" when ``quant_model_description.json`` marks the experts so, else "none"."""
    file = root / QUANT_DESCRIPTION_NAME
    if not file.exists():
        return "none"
    description = _load_json(file)
    kinds = {str(v) for k, v in description.items() if _EXPERT_RE.match(str(k))}
    if not kinds:
        kinds = {str(description.get("model_quant_type", "FLOAT"))}
    if kinds <= {"FLOAT"}:
        return "none"
    if kinds <= {"W8A8_DYNAMIC"}:
        return "w8a8_dynamic"
    raise WeightLoadError(
        f"{file}: expert tensors are quantized as {sorted(kinds)}; ftengine loads only "
        "unquantized (FLOAT) or W8A8_DYNAMIC experts"
    )


@attrs.frozen
class CheckpointIndex:
    """Where every tensor of a checkpoint lives, read from headers only (no tensor data).

    ``config`` is ``config.json`` (empty if absent), ``quant`` is "none" or "w8a8_dynamic".
    """

    path: Path
    config: Mapping[str, Any] = attrs.field(repr=False)
    quant: Quant
    tensors: Mapping[str, TensorInfo] = attrs.field(repr=False)
    files: Mapping[Path, FileHeader] = attrs.field(repr=False)
    missing: Mapping[str, Path] = attrs.field(factory=dict, repr=False)
    experts: Mapping[ExpertKey, str] = attrs.field(factory=dict, repr=False)

    @classmethod
    def open(cls, path: str | Path) -> CheckpointIndex:
        """Index the checkpoint directory ``path``; raises WeightLoadError on a broken one."""
        root = Path(path)
        if not root.is_dir():
            raise WeightLoadError(f"{root}: not a directory; pass a checkpoint directory")
        config_file = root / CONFIG_NAME
        config = _load_json(config_file) if config_file.exists() else {}
        weight_map = _weight_map(root)
        files = {file: read_header(file) for file in sorted(set(weight_map.values()))}
        tensors: dict[str, TensorInfo] = {}
        missing: dict[str, Path] = {}
        for name, file in weight_map.items():
            info = files[file].tensors.get(name)
            if info is None:
                missing[name] = file
            else:
                tensors[name] = info
        experts: dict[ExpertKey, str] = {}
        for name in tensors:
            match = _EXPERT_RE.match(name)
            if match:
                layer, expert, projection, param = match.groups()
                experts[(int(layer), int(expert), projection, param)] = name
        return cls(root, config, detect_quant(root), tensors, files, missing, experts)

    def info(self, name: str) -> TensorInfo:
        """Header facts of tensor ``name``; raises WeightLoadError naming file and tensor."""
        found = self.tensors.get(name)
        if found is not None:
            return found
        if name in self.missing:
            raise WeightLoadError(
                f"{self.missing[name]}: tensor {name!r} is listed in {INDEX_NAME} but missing "
                "from the file; re-create or re-download that shard"
            )
        raise WeightLoadError(f"{self.path}: no tensor {name!r} in the checkpoint")

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor into a fresh, owned CPU tensor (not a view of the file)."""
        info = self.info(name)
        try:
            with safe_open(str(info.file), framework="pt", device="cpu") as handle:
                tensor: torch.Tensor = handle.get_tensor(name)
                return tensor.clone()
        except READ_ERRORS as exc:
            raise WeightLoadError(f"{info.file}: cannot read tensor {name!r} ({exc})") from exc

    def expert_tensor(
        self, layer: int, expert: int, projection: str, param: str = "weight"
    ) -> TensorInfo:
        """Header facts of one expert tensor; raises WeightLoadError if the checkpoint lacks it."""
        name = self.experts.get((layer, expert, projection, param))
        return self.info(name or expert_tensor_name(layer, expert, projection, param))

    def has_expert_tensor(self, layer: int, expert: int, projection: str, param: str) -> bool:
        """Whether (layer, expert, projection, param) is present in the checkpoint."""
        return (layer, expert, projection, param) in self.experts

    def fused_gate_up(self, layer: int, expert: int) -> bool:
        """Whether this expert is stored with a fused ``gate_up_proj`` instead of gate and up."""
        return self.has_expert_tensor(layer, expert, "gate_up_proj", "weight")

    @property
    def expert_bytes_total(self) -> int:
        """Bytes of every expert tensor (weights, scales, offsets) in the checkpoint."""
        return sum(self.tensors[name].nbytes for name in self.experts.values())

    def _config_int(self, key: str, inferred: int | None) -> int:
        value = self.config.get(key, inferred)
        if value is None:
            raise WeightLoadError(
                f"{self.path / CONFIG_NAME}: no {key!r} and it cannot be inferred from the "
                "expert tensors; add it to config.json"
            )
        try:
            return int(value)
        except (TypeError, ValueError) as exc:
            raise WeightLoadError(
                f"{self.path / CONFIG_NAME}: {key!r} must be an integer, found {value!r}; "
                "fix config.json"
            ) from exc

    def _first_weight(self, projection: str) -> TensorInfo | None:
        for (_, _, proj, param), name in self.experts.items():
            if proj == projection and param == "weight":
                return self.tensors[name]
        return None

    @property
    def hidden_size(self) -> int:
        """H: ``hidden_size`` from config.json, else a down_proj's first dimension."""
        down = self._first_weight("down_proj")
        return self._config_int("hidden_size", None if down is None else down.shape[0])

    @property
    def intermediate_size(self) -> int:
        """I: ``moe_intermediate_size`` from config.json, else a down_proj's second dimension."""
        down = self._first_weight("down_proj")
        return self._config_int("moe_intermediate_size", None if down is None else down.shape[1])

    @property
    def num_experts(self) -> int:
        """Logical experts per layer: ``num_experts``, else the highest expert id + 1."""
        top = max((key[1] for key in self.experts), default=None)
        return self._config_int("num_experts", None if top is None else top + 1)

    @property
    def num_layers(self) -> int:
        """``num_hidden_layers``, else the highest layer id holding experts + 1."""
        top = max((key[0] for key in self.experts), default=None)
        return self._config_int("num_hidden_layers", None if top is None else top + 1)

    @property
    def dtype(self) -> torch.dtype:
        """The model dtype: ``dtype`` (transformers 5) or ``torch_dtype`` (transformers 4) in
        config.json, else the first float tensor's."""
        key = "dtype" if isinstance(self.config.get("dtype"), str) else "torch_dtype"
        name = self.config.get(key)
        if isinstance(name, str):
            dtype = getattr(torch, name.removeprefix("torch."), None)
            if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
                return dtype
            raise WeightLoadError(
                f"{self.path / CONFIG_NAME}: {key} {name!r} is not a torch float dtype"
            )
        for info in self.tensors.values():
            found = DTYPES.get(info.dtype)
            if found is not None and found.is_floating_point:
                return found
        raise WeightLoadError(f"{self.path}: no torch_dtype in config.json and no float tensor")
