"""A converted Hugging Face model (a weights-only step-0 checkpoint) resumed by gloo ranks: each
rank loads its pieces of the checkpoint's whole tensors and the job trains as one process does."""

import json

import pytest
import torch
from conftest import TINY_OVERRIDES, cli_args, run_cli, write_text_corpus

from moefold.cli import main

transformers = pytest.importorskip("transformers")


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def test_a_converted_model_resumes_under_fsdp_and_ep_as_in_one_process(tmp_path):
    """A tied Qwen3-MoE head (one tensor FSDP shards for both names) and stacked experts cut by
    EP: the weights-only load fills each rank's pieces, and the losses are the one process's."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "hf")
    for run in ("one", "two"):
        assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / run)]) == 0
    overrides = {k: v for k, v in TINY_OVERRIDES.items() if not k.startswith(("model.", "moe."))}
    overrides.update({"data.path": str(write_text_corpus(tmp_path / "corpus")), "train.steps": "3",
                      "train.warmup_steps": "0"})
    one = run_cli(["train", "--resume", str(tmp_path / "one"), *cli_args(overrides)])
    assert one.returncode == 0, one.stderr
    two = run_cli(["train", "--resume", str(tmp_path / "two"), *cli_args(overrides), "--nproc", "2",
                   "--parallel.ep", "2", "--train.micro_batch_size", "2"])  # the same global batch
    assert two.returncode == 0, two.stderr
    losses_one, losses_two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(losses_one) == len(losses_two) == 3
    assert max(abs(a - b) / a for a, b in zip(losses_one, losses_two)) < 1e-5
