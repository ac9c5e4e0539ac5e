"""Generation's model computes the rows its tokens route, not the padding a run trained with."""

import torch

from moefold.cli import main
from moefold.generate import load_model_from_run
from moefold.moe.layer import MoELayer


def _rows_into_experts(model) -> list[list[int]]:
    """Per MoE layer, a list that gets the rows of every input its experts read from now on."""
    rows = []
    for layer in model.layers:
        if isinstance(layer.ffn, MoELayer):
            layer_rows: list[int] = []
            layer.ffn.experts.register_forward_pre_hook(lambda _, args, r=layer_rows: r.append(args[0].shape[0]))
            rows.append(layer_rows)
    return rows


def test_a_run_trained_with_padded_experts_decodes_without_the_padding(tmp_path, tiny_args):
    """moe.pad_multiple = m gave every expert up to m − 1 zero rows: E·(m − 1) rows of expert
    GEMMs for each decode step's K routed copies (FP8 training's alignment, idle at generation)."""
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2", "--train.warmup_steps", "1",
                 "--moe.pad_multiple", "16"]) == 0
    model, _, cfg = load_model_from_run(run, "cpu")
    assert cfg.moe.pad_multiple == 16  # the run's config, as trained
    ids_BS = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full_BSV = model(ids_BS)
        rows = _rows_into_experts(model)
        cache = model.new_cache(9)
        model.decode(ids_BS[:, :8], cache)
        last_BSV = model.decode(ids_BS[:, 8:], cache)
    top_k = cfg.moe.top_k
    assert rows and all(layer_rows == [8 * top_k, top_k] for layer_rows in rows)
    torch.testing.assert_close(last_BSV, full_BSV[:, 8:], rtol=1e-4, atol=1e-5)
