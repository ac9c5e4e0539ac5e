"""Edges of sequence sharding: what the ranks of a CP group hold (seq_len / cp tokens of each
sequence) is what their TP ranks split, under sequence parallelism and for the routed experts."""

import re

import pytest

from moefold.cli import main
from moefold.config import load_config
from moefold.errors import ConfigError

CP2_TP4 = {"parallel.cp": "2", "parallel.tp": "4", "model.n_kv_heads": "4", "train.seq_len": "12"}


def test_sequence_parallelism_splits_each_cp_ranks_share_of_the_sequence():
    """seq_len 12 splits into 2·cp chunks, but a CP rank's 6 tokens do not split over tp=4."""
    with pytest.raises(ConfigError, match=re.escape(
            "parallel.sequence_parallel needs train.seq_len=12 divisible by parallel.cp·tp = 8")):
        load_config("tiny-qwen3", CP2_TP4)
    load_config("tiny-qwen3", {**CP2_TP4, "train.seq_len": "16"})


def test_routed_tokens_of_a_cp_rank_must_split_over_tp():
    """Without sequence parallelism the TP ranks split a CP rank's micro-batch: 1 · 12 / 2 = 6."""
    no_sp = {**CP2_TP4, "parallel.sequence_parallel": "false", "train.micro_batch_size": "1"}
    with pytest.raises(ConfigError, match=re.escape(
            "parallel.tp=4 does not divide the 6 tokens of a micro-batch "
            "(train.micro_batch_size · train.seq_len / parallel.cp)")):
        load_config("tiny-qwen3", no_sp)
    load_config("tiny-qwen3", {**no_sp, "train.micro_batch_size": "2"})


def test_plan_memory_refuses_the_layout_in_one_line(capsys):
    assert main(["plan", "memory", "--config", "tiny-qwen3", "--train.warmup_steps", "0",
                 *[a for k, v in CP2_TP4.items() for a in (f"--{k}", v)]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "divisible by parallel.cp·tp = 8" in err
