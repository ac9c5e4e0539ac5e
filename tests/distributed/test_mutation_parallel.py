"""Parallel code paths that a mutation of the source could break without any other test noticing
(found by mutation testing of parallel/ and moe/dispatch.py): each compares with one process or
with the documented refusal, on gloo ranks.
"""

import pytest
import torch
import torch.distributed as dist
from conftest import write_text_corpus
from layouts import assert_records_close, fit_on_rank, logged_records
from layouts import config as layout_config
from moe_reference import build
from ranks import run_ranks

from moefold.config import MoEConfig, load_config
from moefold.errors import ConfigError
from moefold.models.transformer import build_model
from moefold.moe.dispatch import LocalDispatcher
from moefold.moe.permute import RowLayout
from moefold.moe.router import Routing
from moefold.parallel.apply import parallelize
from moefold.parallel.dims import ParallelDims, ParallelLayout
from moefold.parallel.expert import apply_ep
from moefold.train.trainer import Trainer

VOCAB = 64
TP2_ETP2_EP2 = {"parallel.tp": "2", "parallel.etp": "2", "parallel.ep": "2", "parallel.data_parallel": "ddp"}


def _filled_model_forward(rank: int, out) -> None:
    """parallelize on a model already filled (as plan/measure.py and tests/memory_runs.py call it,
    not the trainer's meta-device model, whose pieces are drawn after sharding): each rank keeps
    its own hidden slice of its experts, so the logits are the one-process model's."""
    dist.init_process_group("gloo")
    cfg = load_config("tiny-qwen3", TP2_ETP2_EP2)
    ids_BS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    one = build_model(cfg, VOCAB)
    one.init_weights(seed=0)
    model = build_model(cfg, VOCAB)
    model.init_weights(seed=0)
    parallelize(model, ParallelLayout(ParallelDims(4, tp=2, etp=2, ep=2)), cfg.parallel)
    with torch.no_grad():
        torch.testing.assert_close(model(ids_BS), one(ids_BS), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"rank {rank} logits: {m}")


def test_parallelizing_a_filled_model_under_etp_keeps_each_rank_s_hidden_slice(tmp_path):
    run_ranks(4, _filled_model_forward, tmp_path / "out.pt")


def _refuses_indivisible_hidden(rank: int) -> None:
    dist.init_process_group("gloo")
    layer = build(MoEConfig(num_experts=2, top_k=1, expert_hidden=5, experts_backend="loop"), 8, 0)
    with pytest.raises(ConfigError, match=r"^parallel.etp=2 does not divide moe.expert_hidden=5$"):
        apply_ep(layer, dist.group.WORLD, ep_of_rank=[0, 0], etp_rank=rank, etp_size=2)


def test_apply_ep_refuses_a_hidden_size_etp_does_not_divide():
    """apply_ep called directly (the config's check does not run): 5 hidden features over etp 2
    would silently drop the fifth."""
    run_ranks(2, _refuses_indivisible_hidden)


def test_every_logged_value_under_sequence_parallel_tp_is_one_process(tmp_path):
    """Under tp2 with sequence parallelism each rank routes its half of every sequence, so the
    load statistics (routing entropy, each aux loss per layer, load imbalance) are sums over the TP
    group's shards: every logged value is one process's (1e-4 relative), not rank 0's half."""
    corpus = write_text_corpus(tmp_path / "corpus")
    extra = {"logging.log_every": "2"}
    Trainer(layout_config("qwen3", corpus, steps=2, extra=extra), tmp_path / "one", out=lambda line: None).fit()
    run_ranks(2, fit_on_rank, layout_config("qwen3", corpus, steps=2, extra=extra, tp=2), tmp_path / "tp2")
    one, tp2 = logged_records(tmp_path / "one"), logged_records(tmp_path / "tp2")
    assert [sorted(r) for r in tp2] == [sorted(r) for r in one]
    assert any(key.startswith("aux") or "entropy" in key for r in one for key in r), one[0].keys()
    assert_records_close(tp2, one)


@pytest.mark.parametrize("probs_applied_by_experts", [True, False], ids=["sum", "weighted"])
def test_combine_sums_bf16_copies_in_fp32(probs_applied_by_experts):
    """combine's sum over a token's K copies is done in fp32 (the EP dispatchers share it): bf16
    copies 1 and 2^-9 add up to 1 + 2^-9, which a bf16 sum rounds back to 1."""
    idx_TK = torch.tensor([[0, 1]])
    probs_TK = torch.ones(1, 2)
    routing = Routing(probs_TK, idx_TK, torch.full((1, 2), 0.5), torch.zeros(1, 2))
    dispatcher = LocalDispatcher(2, RowLayout(2, 2), probs_applied_by_experts)
    dispatched = dispatcher.dispatch(torch.zeros(1, 1), routing, torch.ones(2, dtype=torch.bool))
    y_RD = torch.tensor([[1.0], [2.0 ** -9]], dtype=torch.bfloat16)  # expert 0's row, then expert 1's
    y_TD = dispatcher.combine(y_RD, dispatched.handle)
    assert y_TD.dtype == torch.float32
    assert y_TD.item() == 1 + 2.0 ** -9
