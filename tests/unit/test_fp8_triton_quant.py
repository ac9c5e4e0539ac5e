"""The Triton column quantizers (fp8/triton_quant.py) against a naive reference, byte for byte,
under Triton's CPU interpreter (skipped where Triton is not installed, as in CI;
tests/gpu/test_fp8_gpu.py runs the same comparison compiled on the H200)."""

from triton_interpreter import needs_triton, run_interpreted

COMPARE = """
import torch
import triton
import triton.language as tl
from moefold.fp8.grouped import TritonColumnQuantizer
from moefold.fp8.recipes import Operand, E4M3, E5M2

# The interpreter's own fp32 -> fp8 cast is not the GPU's (it drops the carry when a mantissa rounds
# up into the next binade, and rounds ties away from even), so the expected bytes are the naive
# reference's fp32 values cast by that same interpreter: equal iff amax, scale, division, masks
# and layout agree. On the H200, tests/gpu/test_fp8_gpu.py compares against torch's cast instead.
@triton.jit
def _cast(x_ptr, o_ptr, n, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(o_ptr + i, tl.load(x_ptr + i, mask=i < n).to(o_ptr.dtype.element_ty), mask=i < n)

def interpreter_cast(q, dtype):
    q = q.contiguous()
    out = torch.empty(q.shape, dtype=dtype)
    _cast[(triton.cdiv(q.numel(), 1024),)](q, out, q.numel(), 1024)
    return out

def naive_columns(x_RC, fmt):
    \"\"\"(scaled and clamped fp32 values, scale per column), one group of rows, by the definition.\"\"\"
    amax_C = x_RC.float().abs().amax(dim=0) if x_RC.shape[0] else torch.zeros(x_RC.shape[1])
    scale_C = torch.where(amax_C > 0, amax_C * fmt.inv_max, torch.ones_like(amax_C))
    return (x_RC.float() / scale_C).clamp(-fmt.max, fmt.max), scale_C

def same_bytes(a, b, what):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), what

torch.manual_seed(0)
quantizer = TritonColumnQuantizer()
for fmt in (E4M3, E5M2):
    op = Operand("col", fmt)
    # groups of rows: one empty, one longer than a row block, rows past the last group, R % 16 != 0,
    # C not a multiple of the column block; a column of zeros (scale 1), magnitudes across rows
    sizes = [32, 0, 160, 16, 48]
    R = sum(sizes) + 21
    offsets_E = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x_RC = torch.randn(R, 72, dtype=torch.bfloat16) * torch.logspace(-3, 3, R)[:, None].bfloat16()
    x_RC[:, 5] = 0
    starts = [0] + offsets_E.tolist()[:-1]
    for x in (x_RC, x_RC.t().contiguous().t()):  # row-major, and column-major as grad may come
        xT_CR, scale_EC = quantizer.group_columns_t(x, offsets_E, op)
        assert xT_CR.shape == (72, -(-R // 16) * 16) and xT_CR.is_contiguous()
        for e, (s, n) in enumerate(zip(starts, sizes)):
            q_RC, scale_C = naive_columns(x[s:s + n], fmt)
            assert torch.equal(scale_EC[e], scale_C), ("group scales", e)
            same_bytes(xT_CR[:, s:s + n], interpreter_cast(q_RC.t(), fmt.dtype), ("group values", e))
    # each expert's weight, column-major as the rows kernels read it, and its transpose (grad_input)
    w_EKN = torch.randn(3, 200, 72, dtype=torch.bfloat16) * 0.02
    for w in (w_EKN, w_EKN.transpose(-2, -1)):
        w_fp8, scale_EN = quantizer.weight(w, op)
        assert w_fp8.shape == w.shape and w_fp8.transpose(-2, -1).is_contiguous()
        for e in range(w.shape[0]):
            q_KN, scale_N = naive_columns(w[e], fmt)
            assert torch.equal(scale_EN[e], scale_N), ("weight scales", e)
            same_bytes(w_fp8[e], interpreter_cast(q_KN, fmt.dtype), ("weight values", e))
    # a weight over several column and row tiles, neither a multiple of the tile; a zero column
    w_EKN = torch.randn(2, 130, 300, dtype=torch.bfloat16) * torch.logspace(-2, 2, 300)[None, None, :].bfloat16()
    w_EKN[0, :, 250] = 0
    w_fp8, scale_EN = quantizer.weight(w_EKN, op)
    for e in range(w_EKN.shape[0]):
        q_KN, scale_N = naive_columns(w_EKN[e], fmt)
        assert torch.equal(scale_EN[e], scale_N), ("tiled weight scales", e)
        same_bytes(w_fp8[e], interpreter_cast(q_KN, fmt.dtype), ("tiled weight values", e))
print("ok")
"""


@needs_triton
def test_triton_column_quantizers_match_the_reference_byte_for_byte():
    run_interpreted(COMPARE)
