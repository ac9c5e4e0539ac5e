"""FP8 grouped GEMMs of the routed experts in Triton: rowwise scales applied in the epilogue, blockwise
scales per 128-deep block.

The twin of `torch._scaled_grouped_mm` for the two shapes the experts need (fp8/grouped.py), on the
same operands, layouts and fp32 dequantization scales:

  rows      out_RN = (a_RK · b_EKN[e(r)]) · sa_R[r] · sb_EN[e(r)]      (forward, grad_input)
            groups along the rows; row r belongs to the expert whose row range holds it.
  contract  out_EMN[e] = (a_MR[:, rows e] · b_RN[rows e]) · sa_EM[e] · sb_EN[e]   (grad_weight)
            groups along the contraction.

`offsets_E` holds the groups' cumulative row ends (int32, as torch._grouped_mm takes them); rows
past the last end are neither read nor written. Nothing syncs with the host: the rows kernels' row
tiles are counted per expert on the device, and each program finds its tile's expert by a binary
search over the tiles' cumulative counts. Operand layouts: both K-major (a row-major, b
column-major per expert), as Hopper's FP8 tensor cores read them, and as the CUTLASS backend
already builds them.

The rowwise kernels load their operands through TMA (host-side `TensorDescriptor`s: a_RK and the
experts' weights as one [E·N, K] matrix; a^T and grad^T, both [features, R], for the
contraction). The rows kernel is persistent (one program per SM over all tiles, the tile loop
flattened into the K loop so the next tile's loads overlap this one's epilogue). A TMA tile may
run past its expert's rows: the rows kernel computes the next expert's rows and does not store
them; the contraction zeroes the rows past its group in both operands of its last tile (groups
are multiples of 16 rows, the tile 128 deep; past the last group the bytes are unwritten and may
be NaN). On the H200 they run at 900–1160 TFLOP/s at the Qwen3-30B-A3B and DeepSeek-V2-Lite
expert shapes, against bf16 `torch._grouped_mm`'s 620–710 (each call's device work, replayed from
a CUDA graph: timed eagerly their host-side launch adds 0.1-0.4 ms; docs/benchmarks.md, seventh
pass). They are opaque custom ops to torch.compile: torch 2.11's Inductor fails on a traced
kernel that takes TensorDescriptors ("tolist() shouldn't be called on a tensor with unallocated
storage"), and a standalone kernel gains nothing from tracing.

Blockwise (DeepSeek-V3's 1x128 activation, 128x128 weight and 128x1 weight-gradient scales, for
which torch has no grouped kernel on Hopper) has its own pair, `*_blockwise`, pointer-based and
traced by torch.compile (`torch.library.triton_op`): the K loop steps one 128-wide scale block at
a time and scales each partial product before accumulating it in fp32.

Triton is optional: without it this module imports, `HAS_TRITON` is False and the ops are absent.

Launch order: the output-column tile is the fastest axis of the grid (of the persistent loop),
so the programs in flight together share their row tile (rows kernels: one A tile read by all N
tiles at once, the expert's B from L2) or their expert (contract kernels: every (M, N) tile of one
expert's x^T and grad slices at once), and each operand crosses HBM about once instead of once
per tile of the other dimension (6-16 times at the Qwen3 shapes): the pointer-based forward at
Qwen3's shape went from 0.98 to 0.72 ms.

Legend: R rows, K contraction (rows kernel), M and N output features, E experts; BM, BN, BK tiles.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only installs
    triton = None
HAS_TRITON = triton is not None

# Tiles measured on the H200 at Qwen3-30B-A3B's expert shape (benchmarks/fp8_grouped.py --sweep,
# docs/benchmarks.md, fourth pass): 128x256 tiles, 8 warps, for every width.
ROWS_TILES = {"BM": 128, "BN": 256, "BK": 128, "num_warps": 8, "num_stages": 3}
CONTRACT_TILES = {"BM": 128, "BN": 256, "BK": 128, "num_warps": 8, "num_stages": 3}
# Blockwise (DeepSeek-V3's 1x128 / 128x128 / 128x1 scales): the K step is the 128-wide scale block,
# and the rows kernel's output tile is one 128-column weight block. Untuned: 380-480 TFLOP/s on the H200.
BLOCK = 128
BLOCKWISE_TILES = {"BM": 128, "num_warps": 8, "num_stages": 3}
BLOCKWISE_CONTRACT_TILES = {"BM": 128, "BN": 128, "num_warps": 8, "num_stages": 3}


def _processors(device: torch.device) -> int:
    """The persistent rows kernel's program count: one per SM (a few under the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension


def _row_tiles_bound(R: int, E: int, bm: int) -> int:
    """An upper bound of the rows kernels' row tiles, cdiv(R, BM) + E (the grid's second axis)."""
    tiles = -(-R // bm) + E
    if tiles > MAX_GRID_Y:
        raise ValueError(f"FP8 grouped GEMM: {R} rows over {E} experts need {tiles} row tiles of {bm}, "
                         f"more than a CUDA grid holds ({MAX_GRID_Y}); use fewer tokens per micro-batch")
    return tiles


def _row_tile_ends(offsets_E: torch.Tensor, bm: int) -> torch.Tensor:
    """Cumulative count of BM-row tiles over the experts (int32, on the device)."""
    rows_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
    return ((rows_E + bm - 1) // bm).cumsum(0).to(torch.int32)


def row_tile_ends(offsets_E: torch.Tensor) -> torch.Tensor:
    """The rowwise rows op's schedule (`fp8_grouped_mm_rows`' tile_ends_E), built by its caller:
    there torch.compile fuses its few ops into one kernel, where inside the opaque op they would
    launch one by one, on every call (36 calls a step at six MoE layers)."""
    return _row_tile_ends(offsets_E, ROWS_TILES["BM"])


def _row_schedule(offsets_E: torch.Tensor, R: int, bm: int) -> tuple[torch.Tensor, int]:
    """The blockwise rows kernel's sync-free schedule: each expert's cumulative tile count (on the device)
    and the bound of all tiles that the grid's second axis launches."""
    return _row_tile_ends(offsets_E, bm), _row_tiles_bound(R, offsets_E.shape[0], bm)


if HAS_TRITON:

    @triton.jit
    def _expert_of_tile(tile_ends_ptr, pid_m, E, SEARCH_STEPS: tl.constexpr):
        """The smallest e in [0, E] with tile_ends[e] > pid_m (E: past the last tile), by a binary
        search of SEARCH_STEPS >= log2(E + 1) halvings; once found, further steps change nothing."""
        lo = pid_m * 0
        hi = lo + E
        for _ in tl.static_range(SEARCH_STEPS):
            searching = lo < hi
            mid = (lo + hi) // 2
            right = tl.load(tile_ends_ptr + tl.minimum(mid, E - 1)) <= pid_m
            hi = tl.where(searching & ~right, mid, hi)
            lo = tl.where(searching & right, mid + 1, lo)
        return lo

    @triton.jit
    def _row_tile(tile_ends_ptr, offsets_ptr, pid_m, E, SEARCH_STEPS: tl.constexpr, BM: tl.constexpr):
        """Row tile pid_m of the rows kernels: (its expert e, whether it holds rows at all, its
        first row, the expert's row end)."""
        e = _expert_of_tile(tile_ends_ptr, pid_m, E, SEARCH_STEPS)
        valid = e < E
        e = tl.minimum(e, E - 1)
        tiles_before = tl.load(tile_ends_ptr + e - 1, mask=e > 0, other=0)
        row_start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0)
        row_end = tl.where(valid, tl.load(offsets_ptr + e), row_start)  # past the last tile: no rows
        return e, valid, row_start + (pid_m - tiles_before) * BM, row_end

    @triton.jit
    def _scale_and_store(acc_MN, sa_ptr, sb_ptr, out_ptr, rows_M, cols_N, row_end, N, stride_or):
        """out[rows, cols] = acc · sa[rows] · sb[cols] in out's dtype, rows past row_end and columns
        past N left unwritten (sa_ptr, sb_ptr: already at this tile's group)."""
        in_rows_M, in_cols_N = rows_M < row_end, cols_N < N
        sa_M = tl.load(sa_ptr + rows_M, mask=in_rows_M, other=0.0)
        sb_N = tl.load(sb_ptr + cols_N, mask=in_cols_N, other=0.0)
        out_MN = (acc_MN * sa_M[:, None] * sb_N[None, :]).to(out_ptr.dtype.element_ty)
        out_ptrs = out_ptr + rows_M[:, None].to(tl.int64) * stride_or + cols_N[None, :]
        tl.store(out_ptrs, out_MN, mask=in_rows_M[:, None] & in_cols_N[None, :])

    @triton.jit
    def _fp8_grouped_gemm_rows(a_desc, b_desc, sa_ptr, sb_ptr, out_ptr, offsets_ptr, tile_ends_ptr, N, K, E,
                               stride_or, SEARCH_STEPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                               BK: tl.constexpr, PROGRAMS: tl.constexpr):
        """Persistent: PROGRAMS programs (one per SM) stride over the output tiles, column tiles
        fastest (the launch order in the docstring); the tile loop is flattened into the K loop so
        that the next tile's loads start during this tile's epilogue. a_desc over a_RK, b_desc over
        the weights as [E·N, K] (each expert's b column-major). Rows of a tile past its expert's end
        (the next expert's, or past R: TMA's zeros) and columns past N (the next expert's weight)
        are computed and never stored."""
        col_tiles = tl.cdiv(N, BN)
        tiles = tl.load(tile_ends_ptr + E - 1) * col_tiles  # on the device: no host sync
        for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
            pid_m, pid_n = tile // col_tiles, tile % col_tiles
            e, _, row0, row_end = _row_tile(tile_ends_ptr, offsets_ptr, pid_m, E, SEARCH_STEPS, BM)
            col0 = pid_n * BN
            acc_MN = tl.zeros((BM, BN), dtype=tl.float32)
            for k in range(0, tl.cdiv(K, BK)):
                a_MK = a_desc.load([row0, k * BK])
                b_NK = b_desc.load([e * N + col0, k * BK])
                acc_MN = tl.dot(a_MK, b_NK.T, acc_MN)
            _scale_and_store(acc_MN, sa_ptr, sb_ptr + e * N, out_ptr, row0 + tl.arange(0, BM),
                             col0 + tl.arange(0, BN), row_end, N, stride_or)

    @triton.jit
    def _fp8_grouped_gemm_contract(a_desc, b_desc, sa_ptr, sb_ptr, out_ptr, offsets_ptr, M, N,
                                   stride_oe, stride_om, BM: tl.constexpr, BN: tl.constexpr,
                                   BK: tl.constexpr):
        """a_desc over a_MR (x^T), b_desc over b_RN^T (grad^T, [N, R]): both read along the rows.
        Groups are multiples of 16 rows, not of BK: the expert's last tile reaches into the next
        expert's rows (or past the last group, where the quantizers leave bytes unwritten: they
        may be NaN), zeroed in both operands before the product."""
        pid_n, pid_m, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        row_start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0)
        row_end = tl.load(offsets_ptr + e)
        m0, n0 = pid_m * BM, pid_n * BN
        full_steps = (row_end - row_start) // BK
        acc_MN = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, full_steps):
            a_MK = a_desc.load([m0, row_start + k * BK])
            b_NK = b_desc.load([n0, row_start + k * BK])
            acc_MN = tl.dot(a_MK, b_NK.T, acc_MN)
        tail = row_start + full_steps * BK
        if tail < row_end:
            in_rows_K = tail + tl.arange(0, BK) < row_end
            a_MK = a_desc.load([m0, tail])
            b_NK = b_desc.load([n0, tail])
            a_MK = tl.where(in_rows_K[None, :], a_MK, tl.zeros_like(a_MK))
            b_NK = tl.where(in_rows_K[None, :], b_NK, tl.zeros_like(b_NK))
            acc_MN = tl.dot(a_MK, b_NK.T, acc_MN)
        _scale_and_store(acc_MN, sa_ptr + e * M, sb_ptr + e * N, out_ptr + e.to(tl.int64) * stride_oe,
                         m0 + tl.arange(0, BM), n0 + tl.arange(0, BN), M, N, stride_om)

    @triton.jit
    def _fp8_grouped_gemm_rows_blockwise(
            a_ptr, b_ptr, sa_ptr, sb_ptr, out_ptr, offsets_ptr, tile_ends_ptr, N, K, E,
            stride_ar, stride_ak, stride_be, stride_bk, stride_bn, stride_or, stride_on,
            stride_sar, stride_sbe, stride_sbk, SEARCH_STEPS: tl.constexpr, BM: tl.constexpr,
            BLOCK: tl.constexpr):
        """The rows GEMM with DeepSeek-V3's scales: a's per row and 128-column block
        (sa_R,Kb), b's per 128x128 block (sb_E,Kb,Nb). Each 128-deep partial product is scaled
        before it is added to the fp32 accumulator (the scales change along K)."""
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)  # the launch order in the docstring
        e, valid, row0, row_end = _row_tile(tile_ends_ptr, offsets_ptr, pid_m, E, SEARCH_STEPS, BM)
        rows_M = row0 + tl.arange(0, BM)
        cols_N = pid_n * BLOCK + tl.arange(0, BLOCK)
        ks_K = tl.arange(0, BLOCK)
        in_rows_M = rows_M < row_end
        a_ptrs = a_ptr + rows_M[:, None].to(tl.int64) * stride_ar + ks_K[None, :] * stride_ak
        b_ptrs = b_ptr + e.to(tl.int64) * stride_be + ks_K[:, None] * stride_bk + cols_N[None, :] * stride_bn
        sa_ptrs = sa_ptr + rows_M.to(tl.int64) * stride_sar
        sb_ptr_e = sb_ptr + e * stride_sbe + pid_n
        acc_MN = tl.zeros((BM, BLOCK), dtype=tl.float32)
        for kb in range(0, tl.where(valid, K // BLOCK, 0)):  # K, N: multiples of BLOCK
            a = tl.load(a_ptrs, mask=in_rows_M[:, None], other=0.0)
            b = tl.load(b_ptrs)
            sa_M = tl.load(sa_ptrs + kb, mask=in_rows_M, other=0.0)
            sb = tl.load(sb_ptr_e + kb * stride_sbk)
            acc_MN += tl.dot(a, b) * (sa_M[:, None] * sb)
            a_ptrs += BLOCK * stride_ak
            b_ptrs += BLOCK * stride_bk
        out_ptrs = out_ptr + rows_M[:, None].to(tl.int64) * stride_or + cols_N[None, :] * stride_on
        tl.store(out_ptrs, acc_MN.to(out_ptr.dtype.element_ty), mask=in_rows_M[:, None])

    @triton.jit
    def _fp8_grouped_gemm_contract_blockwise(
            a_ptr, b_ptr, sa_ptr, sb_ptr, out_ptr, offsets_ptr, M, N,
            stride_am, stride_ar, stride_br, stride_bn, stride_sar, stride_sbr,
            stride_oe, stride_om, stride_on, BM: tl.constexpr, BN: tl.constexpr, BLOCK: tl.constexpr):
        """The weight gradient with 128x1 scales along the rows (sa_Rb,M for a^T's columns, sb_Rb,N):
        group bounds are multiples of BLOCK, so every 128-row block lies in one expert and each
        block's partial product is scaled before it is accumulated."""
        pid_n, pid_m, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        row_start = tl.multiple_of(tl.load(offsets_ptr + e - 1, mask=e > 0, other=0), BLOCK)
        row_end = tl.multiple_of(tl.load(offsets_ptr + e), BLOCK)
        ms_M = pid_m * BM + tl.arange(0, BM)
        ns_N = pid_n * BN + tl.arange(0, BN)
        rs_K = tl.arange(0, BLOCK)
        in_m, in_n = ms_M < M, ns_N < N
        a_ptrs = (a_ptr + row_start.to(tl.int64) * stride_ar + ms_M[:, None].to(tl.int64) * stride_am
                  + rs_K[None, :] * stride_ar)
        b_ptrs = (b_ptr + row_start.to(tl.int64) * stride_br + ns_N[None, :].to(tl.int64) * stride_bn
                  + rs_K[:, None] * stride_br)
        first_block = row_start // BLOCK
        acc_MN = tl.zeros((BM, BN), dtype=tl.float32)
        for rb in range(first_block, row_end // BLOCK):
            a = tl.load(a_ptrs, mask=in_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=in_n[None, :], other=0.0)
            sa_M = tl.load(sa_ptr + rb * stride_sar + ms_M, mask=in_m, other=0.0)
            sb_N = tl.load(sb_ptr + rb * stride_sbr + ns_N, mask=in_n, other=0.0)
            acc_MN += tl.dot(a, b) * (sa_M[:, None] * sb_N[None, :])
            a_ptrs += BLOCK * stride_ar
            b_ptrs += BLOCK * stride_br
        out_ptrs = out_ptr + e.to(tl.int64) * stride_oe + ms_M[:, None] * stride_om + ns_N[None, :] * stride_on
        tl.store(out_ptrs, acc_MN.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])

    @torch.library.custom_op("moefold::fp8_grouped_mm_rows", mutates_args=())
    def fp8_grouped_mm_rows(a_RK: torch.Tensor, b_EKN: torch.Tensor, sa_R: torch.Tensor, sb_EN: torch.Tensor,
                            offsets_E: torch.Tensor, tile_ends_E: torch.Tensor) -> torch.Tensor:
        """bf16 out_RN: groups along the rows (forward and grad_input). Rows past the last group
        are left unwritten, as torch._grouped_mm leaves them (the MoE layer never reads them).
        tile_ends_E: `row_tile_ends(offsets_E)`."""
        (R, K), (E, _, N) = a_RK.shape, b_EKN.shape
        t = ROWS_TILES
        out_RN = torch.empty(R, N, device=a_RK.device, dtype=torch.bfloat16)
        tiles_bound = (triton.cdiv(R, t["BM"]) + E) * triton.cdiv(N, t["BN"])
        b_NK = b_EKN.transpose(-2, -1).contiguous().view(E * N, K)  # no copy: column-major per expert
        a_desc = TensorDescriptor.from_tensor(a_RK.contiguous(), [t["BM"], t["BK"]])
        b_desc = TensorDescriptor.from_tensor(b_NK, [t["BN"], t["BK"]])
        programs = min(_processors(a_RK.device), tiles_bound)
        _fp8_grouped_gemm_rows[(programs,)](
            a_desc, b_desc, sa_R.contiguous(), sb_EN.contiguous(), out_RN, offsets_E, tile_ends_E, N, K, E,
            out_RN.stride(0), SEARCH_STEPS=E.bit_length(), PROGRAMS=programs, **t)
        return out_RN

    @fp8_grouped_mm_rows.register_fake
    def _(a_RK, b_EKN, sa_R, sb_EN, offsets_E, tile_ends_E):
        return a_RK.new_empty(a_RK.shape[0], b_EKN.shape[2], dtype=torch.bfloat16)

    @torch.library.custom_op("moefold::fp8_grouped_mm_contract", mutates_args=())
    def fp8_grouped_mm_contract(a_MR: torch.Tensor, b_RN: torch.Tensor, sa_EM: torch.Tensor,
                                sb_EN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        """bf16 out_EMN: groups along the contraction (grad_weight); an empty group gives zeros.
        a^T and b^T row-major ([M, R], [N, R]; R a multiple of 16), as contract_operands gives them."""
        (M, _), N, E = a_MR.shape, b_RN.shape[1], offsets_E.shape[0]
        t = CONTRACT_TILES
        out_EMN = torch.empty(E, M, N, device=a_MR.device, dtype=torch.bfloat16)
        a_desc = TensorDescriptor.from_tensor(a_MR.contiguous(), [t["BM"], t["BK"]])
        b_desc = TensorDescriptor.from_tensor(b_RN.t().contiguous(), [t["BN"], t["BK"]])
        _fp8_grouped_gemm_contract[(triton.cdiv(N, t["BN"]), triton.cdiv(M, t["BM"]), E)](
            a_desc, b_desc, sa_EM.contiguous(), sb_EN.contiguous(), out_EMN, offsets_E, M, N,
            out_EMN.stride(0), out_EMN.stride(1), **t)
        return out_EMN

    @fp8_grouped_mm_contract.register_fake
    def _(a_MR, b_RN, sa_EM, sb_EN, offsets_E):
        return a_MR.new_empty(offsets_E.shape[0], a_MR.shape[0], b_RN.shape[1], dtype=torch.bfloat16)

    @triton_op("moefold::fp8_grouped_mm_rows_blockwise", mutates_args=())
    def fp8_grouped_mm_rows_blockwise(a_RK: torch.Tensor, b_EKN: torch.Tensor, sa_RKb: torch.Tensor,
                                      sb_EKbNb: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        """bf16 out_RN with 1x128 scales of a and 128x128 of b; rows past the last group unwritten."""
        (R, K), (E, _, N) = a_RK.shape, b_EKN.shape
        t = BLOCKWISE_TILES
        out_RN = torch.empty(R, N, device=a_RK.device, dtype=torch.bfloat16)
        tile_ends_E, row_tiles = _row_schedule(offsets_E, R, t["BM"])
        grid = (N // BLOCK, row_tiles)
        wrap_triton(_fp8_grouped_gemm_rows_blockwise)[grid](
            a_RK, b_EKN, sa_RKb, sb_EKbNb, out_RN, offsets_E, tile_ends_E, N, K, E,
            a_RK.stride(0), a_RK.stride(1), b_EKN.stride(0), b_EKN.stride(1), b_EKN.stride(2),
            out_RN.stride(0), out_RN.stride(1), sa_RKb.stride(0), sb_EKbNb.stride(0), sb_EKbNb.stride(1),
            SEARCH_STEPS=E.bit_length(), BLOCK=BLOCK, **t)
        return out_RN

    @triton_op("moefold::fp8_grouped_mm_contract_blockwise", mutates_args=())
    def fp8_grouped_mm_contract_blockwise(a_MR: torch.Tensor, b_RN: torch.Tensor, sa_RbM: torch.Tensor,
                                          sb_RbN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        """bf16 out_EMN with 128x1 scales along the rows of both; an empty group gives zeros."""
        (M, _), N, E = a_MR.shape, b_RN.shape[1], offsets_E.shape[0]
        t = BLOCKWISE_CONTRACT_TILES
        out_EMN = torch.empty(E, M, N, device=a_MR.device, dtype=torch.bfloat16)
        grid = (triton.cdiv(N, t["BN"]), triton.cdiv(M, t["BM"]), E)
        wrap_triton(_fp8_grouped_gemm_contract_blockwise)[grid](
            a_MR, b_RN, sa_RbM, sb_RbN, out_EMN, offsets_E, M, N,
            a_MR.stride(0), a_MR.stride(1), b_RN.stride(0), b_RN.stride(1), sa_RbM.stride(0),
            sb_RbN.stride(0), out_EMN.stride(0), out_EMN.stride(1), out_EMN.stride(2), BLOCK=BLOCK, **t)
        return out_EMN
