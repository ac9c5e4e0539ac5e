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
(moe/grouped_mm.py, which the experts call).
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
    """Replace every block's forward (main and MTP blocks) by its compiled version, in place."""
    for block in model.blocks():
        block.forward = torch.compile(block.forward, dynamic=False)
