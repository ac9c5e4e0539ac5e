"""Memory (and later time) planning for large clusters, from the config alone.

`predict_memory(cfg, world_size) -> MemoryPlan` (plan.memory) is the API the trainer and
`moefold plan memory` call; `measure_saved_activations` (plan.measure) is its independent check on
small configs.
"""

from moefold.plan.memory import DEVICES_GB, MemoryPlan, predict_memory

__all__ = ["DEVICES_GB", "MemoryPlan", "predict_memory"]
