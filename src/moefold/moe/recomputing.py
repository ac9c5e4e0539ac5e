"""Whether an MoE forward is a checkpoint's recompute that moefold did not set up.

torch.utils.checkpoint (and `checkpoint_wrapper`, and FSDP's activation checkpointing, built on it)
runs a wrapped module's forward a second time during backward, and cannot tell the module so.
moefold's own recompute (memory.recompute, memory/moe_tape.py) replays the forward's decisions and
records nothing; under torch's, the MoE layer finds out here, by being inside a backward pass, that
its forward already recorded the statistics and the step's counts, and that the counts of the
global-batch balancing loss already hold this micro-batch.
"""

import torch


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass (a checkpoint's recompute runs from there:
    an unpack hook, or the reentrant checkpoint's backward). Code being traced by torch.compile
    takes itself for a forward, as asking would break the graph: a compiled forward that torch's
    checkpoint recomputes still records twice (docs/python.md)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1  # torch.utils.checkpoint asks the same
