"""torch._grouped_mm under torch.compile in every compute dtype.

Its meta kernel accepts bf16 only (torch 2.11–2.13) while eager also runs fp32: outside bf16 the
grouped GEMM stays eager, the compiled graph broken around it. The grouped-GEMM experts and the FP8
emulation call `grouped_mm`.
"""

import torch


@torch.compiler.disable
def eager_grouped_mm(x_RX: torch.Tensor, w_EXY: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x_RX, w_EXY, offs=offsets_E)


def grouped_mm(x_RX: torch.Tensor, w_EXY: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm, traced by torch.compile in bf16 and run eagerly otherwise."""
    if x_RX.dtype == torch.bfloat16:
        return torch._grouped_mm(x_RX, w_EXY, offs=offsets_E)
    return eager_grouped_mm(x_RX, w_EXY, offsets_E)
