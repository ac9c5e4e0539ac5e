"""Activation memory: fine-grained recompute and host offload of saved activations, applied to a
built model by name (config.MEMORY_MODULES; memory/sites.py says where each name lives)."""

from moefold.memory.offload import ActivationOffload, apply_offload
from moefold.memory.recompute import apply_recompute

__all__ = ["ActivationOffload", "apply_offload", "apply_recompute"]
