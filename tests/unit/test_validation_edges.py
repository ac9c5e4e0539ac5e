"""Validation when the validation batch does not split evenly over the data ranks (a small set's
one batch of every sequence: 3 sequences over dp 2 are 2 and 1 rows). The static-shape EP
dispatchers (capacity all-to-all with pad_to_capacity, all-gather) need the same token count on
every rank of the group: the uneven split failed their check in the final validation, before the
last checkpoint was written. Each rank's rows are now padded to the most any rank holds (no
labels, no expert), and the loss is the one process's."""

import json
import sys
from pathlib import Path

import pytest
import torch

from moefold.config import load_config
from moefold.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import write_text_corpus  # noqa: E402
from ranks import run_ranks  # noqa: E402

ROWS = 3  # validation sequences: 2 and 1 on dp 2

# capacity_factor 4 = num_experts / top_k: an expert takes every token, so no rank drops one and
# the padded capacity run is comparable with the dropless one process.
DISPATCHERS = {"alltoall-padded-capacity": {"parallel.ep_dispatcher": "alltoall", "moe.capacity_factor": "4.0",
                                            "moe.pad_to_capacity": "true"},
               "allgather": {"parallel.ep_dispatcher": "allgather"}}


def _config(corpus: Path, dp: int, extra: dict[str, str]):
    return load_config("tiny-qwen3", {
        "data.path": str(corpus), "train.seq_len": "16", "train.micro_batch_size": str(4 // dp),
        "train.steps": "1", "train.warmup_steps": "0", "train.device": "cpu", "logging.tensorboard": "false",
        "logging.progress_bar": "false", "logging.expert_load_heatmap": "false", **extra})


def _val_loss(cfg, run_dir: Path) -> float:
    trainer = Trainer(cfg, run_dir, out=lambda line: None)
    dp, rank = trainer.dist.dp_size, trainer.dist.dp_rank
    # The first ROWS sequences of the first global batch (4 // dp rows a rank) as the only one: this
    # data rank's share of them (tensor_split's) is the head of its own rows.
    share = len(torch.arange(ROWS).tensor_split(dp)[rank])
    batch = trainer.val_batches[0]
    trainer.val_batches = [type(batch)(*(t[:share] for t in (batch.input_ids_BS, batch.labels_BS, batch.doc_ids_BS)))]
    trainer._val_rows_any_rank = [-(-ROWS // dp)]  # what every rank pads to
    return trainer.validate()


def _on_rank(rank: int, corpus: Path, extra: dict, out_dir: Path) -> None:
    loss = _val_loss(_config(corpus, 2, {"parallel.ep": "2", **extra}), out_dir / f"run{rank}")
    (out_dir / f"rank{rank}.json").write_text(json.dumps(loss))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_text_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.mark.parametrize("dispatcher", list(DISPATCHERS))
def test_validation_rows_that_do_not_split_evenly_over_ep_ranks(dispatcher, corpus, tmp_path):
    torch.set_num_threads(1)
    reference = _val_loss(_config(corpus, 1, DISPATCHERS[dispatcher]), tmp_path / "one")
    run_ranks(2, _on_rank, corpus, DISPATCHERS[dispatcher], tmp_path)
    losses = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert losses[0] == losses[1]  # summed over the data ranks
    assert losses[0] == pytest.approx(reference, rel=1e-5)
