"""Regional compilation (`train.compile`): torch.compile of each transformer block's forward.

Each block is compiled on its own, as TorchTitan does: blocks of one structure share a compiled
graph (modules are inlined, their parameters are graph inputs), compile time stays that of one
block, and what lies between blocks (FSDP's hooks, embeddings, output head, optimizer) stays
eager. The logits' cross-entropy is compiled on its own too (`compile_loss`). The MoE layer's
shapes do not depend on the routing (the static-shape permutation of moe/permute.py), so its graph
needs no dynamic shapes; under expert parallelism the all-to-all's host-side split sizes break the
graph there and the rest still compiles.

Inductor generates Triton kernels on GPUs and C++ on the CPU (which needs a C++ compiler): the option
is meant for GPUs. `torch._grouped_mm`'s meta kernel accepts bf16 only (torch 2.11–2.13) while
eager also runs fp32: outside bf16 the expert GEMMs stay eager, the graph broken around them
(moe/grouped_mm.py, which the experts call). `build_model` builds memory.recompute's `moe_act` in a
form Dynamo traces when train.compile is on (memory/sites.py).
"""

from __future__ import annotations

import torch
from torch import nn


def compile_loss(loss_fn):
    """The logits' cross-entropy compiled (or the chunked loss's step, train/chunked_loss.py):
    Inductor fuses the fp32 upcast, log-sum-exp and target pick forward, and softmax − one-hot
    backward, into passes over the bf16 logits, where eager writes and reads [T, V] fp32 copies
    (about 10 GB each at 16k tokens × 152k vocabulary)."""
    return torch.compile(loss_fn, dynamic=False)


def compile_blocks(model: nn.Module) -> None:
    """Replace every block's forward (main and MTP blocks) by its compiled version, in place.
    The blocks then refuse a deep copy (`_CompiledForward`)."""
    for block in model.blocks():
        block.forward = torch.compile(block.forward, dynamic=False)
        block._compiled_forward = _CompiledForward()


class _CompiledForward:
    """Held by a block whose forward compile_blocks replaced: that forward wraps the block's own
    bound method, an instance attribute copy.deepcopy keeps as it is, so a copy (an EMA, torch's
    AveragedModel) would run the original's weights and train them in its backward, silently.
    (nn.Module.compile's copies drop its compiled call, a field its __getstate__ leaves out.)
    Refused, as memory.recompute's wrapped modules are."""

    def __deepcopy__(self, memo):
        raise TypeError("cannot deep-copy a model built with train.compile: its blocks' compiled forwards stay "
                        "bound to the original (copy.deepcopy keeps functions as they are), so the copy would run "
                        "and train the original's weights; build the copy with build_model and load_state_dict")
