"""Expert weights: checkpoint index, selective safetensors reload, device-layout transforms."""

from ftengine.weights.checkpoint_gen import make_checkpoint
from ftengine.weights.index import CheckpointIndex
from ftengine.weights.integrity import Manifest
from ftengine.weights.reload import ReloadStats, load_experts_into_slots
from ftengine.weights.slots import ExpertSlots, SlotWeights

__all__ = [
    "CheckpointIndex",
    "ExpertSlots",
    "Manifest",
    "ReloadStats",
    "SlotWeights",
    "load_experts_into_slots",
    "make_checkpoint",
]
