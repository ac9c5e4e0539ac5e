"""`seeded_normal_` fills any piece of a weight with exactly that piece of the weight's definition:
block b of the `[rows, width]` view is `_draw_block` of (seed, name, b), times std, whatever rows
and columns the piece holds, in whatever order, into whatever dtype, on any number of threads."""

import math

import pytest
import torch

import moefold.models.init as init

SEED, NAME, STD = 7, "layers.0.ffn.experts.w1_EDF", 0.02
SHAPE = (3, 10, 8)  # [E, K, N]: 30 rows of 8


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(init, "BLOCK_ELEMENTS", 32)  # 4 rows a block: pieces cross many blocks


def _whole_weight(shape) -> torch.Tensor:
    """The definition, drawn block after block in order: the reference every piece is cut from."""
    *lead, width = shape
    n_rows, rows_per_block = math.prod(lead), init.BLOCK_ELEMENTS // width
    blocks = [init._draw_block((min(rows_per_block, n_rows - first), width), SEED, NAME, first // rows_per_block)
              for first in range(0, n_rows, rows_per_block)]
    return (torch.cat(blocks) * STD).view(shape)


def _fill_piece(monkeypatch, held, dtype=torch.float32, threads=1) -> torch.Tensor:
    """A rank's piece of a [3, 10, 8] parameter holding `held` (as a DTensor would say)."""
    piece_shape = [n if ids is None else len(ids) for ids, n in zip(held, SHAPE, strict=True)]
    piece = torch.full(piece_shape, float("nan"), dtype=dtype)
    monkeypatch.setattr(init, "held_indices", lambda p: held)
    monkeypatch.setattr(init, "local_tensor", lambda p: piece)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        init.seeded_normal_(torch.empty(SHAPE, device="meta"), STD, SEED, NAME)
    finally:
        torch.set_num_threads(before)
    return piece


PIECES = {
    "whole": [None, None, None],
    "experts 1-2 (EP)": [torch.tensor([1, 2]), None, None],
    "rows 3-6 of each expert (FSDP by dim 1)": [None, torch.arange(3, 7), None],
    "strided rows": [None, torch.arange(0, 10, 3), None],
    "rows out of order": [torch.tensor([2, 0]), torch.tensor([9, 1, 4, 5]), None],
    "columns 4-7 (a last-dimension cut)": [None, None, torch.arange(4, 8)],
    "rows and columns out of order": [torch.tensor([1]), torch.tensor([5, 2]), torch.tensor([7, 0, 3])],
    "no rows": [torch.tensor([], dtype=torch.long), None, None],
}


@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize("threads", [1, 3])
def test_a_piece_is_exactly_its_part_of_the_whole_weight(monkeypatch, piece, threads):
    held = PIECES[piece]
    expected = _whole_weight(SHAPE)
    for dim, ids in enumerate(held):
        expected = expected if ids is None else expected.index_select(dim, ids)
    got = _fill_piece(monkeypatch, held, threads=threads)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("piece", ["experts 1-2 (EP)", "rows out of order", "columns 4-7 (a last-dimension cut)"])
def test_a_bf16_piece_holds_the_fp32_draw_rounded_once(monkeypatch, piece):
    held = PIECES[piece]
    fp32 = _fill_piece(monkeypatch, held)
    assert torch.equal(_fill_piece(monkeypatch, held, dtype=torch.bfloat16, threads=2), fp32.bfloat16())


def test_a_parameter_is_filled_in_place():
    weight = torch.nn.Parameter(torch.full(SHAPE, float("nan")))
    init.seeded_normal_(weight, STD, SEED, NAME)
    assert torch.equal(weight.detach(), _whole_weight(SHAPE))


def test_to_empty_then_init_weights_starts_every_buffer_at_zero():
    """TorchTitan's way to materialize a meta model (to_empty, then init_weights) leaves the
    buffers' memory uninitialised; init_weights zeroes them (the MoE counters, the expert bias),
    as build_model makes them, so the first expert-bias update and global aux loss start clean."""
    from moefold.config import load_config
    from moefold.models.transformer import build_model

    cfg = load_config("tiny-deepseek", {"model.n_layers": 2})
    with torch.device("meta"):
        model = build_model(cfg, 64)
    model.to_empty(device="cpu")
    for buffer in model.buffers():
        buffer.fill_(7)  # what uninitialised memory may hold
    model.init_weights(seed=0)
    names = [name for name, _ in model.named_buffers()]
    assert any(name.endswith("expert_bias_E") for name in names)
    assert all(b.eq(0).all() for b in model.buffers()), names
