"""Memory (and later time) planning for large clusters, from the config alone.

`predict_memory(cfg, world_size) -> MemoryPlan` (plan.memory) is the API the trainer and
`moefold plan memory` call; `measure_saved_activations` (plan.measure) is its independent check on
small configs.
"""

from moefold.plan.devices import DEVICES_GB

__all__ = ["DEVICES_GB", "MemoryPlan", "predict_memory"]


def __getattr__(name: str):
    """plan.memory (which imports torch) on first use: the command line's parser imports
    plan.devices through this package and must stay torch-free."""
    if name in ("MemoryPlan", "predict_memory"):
        from moefold.plan import memory
        return getattr(memory, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
