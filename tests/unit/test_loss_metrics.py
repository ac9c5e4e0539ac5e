"""The logged figures against independent counts: the FLOP convention against the matmuls
`FlopCounterMode` sees in one forward and backward plus the attention pairs of the model's mask
counted one by one, the MFU peak against the datasheets, and the validation loss against a naive
token mean."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_OVERRIDES
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from moefold.config import load_config
from moefold.data import IGNORE_INDEX
from moefold.models.transformer import build_model
from moefold.train.flops import PEAK_BF16_TFLOPS, peak_tflops, train_flops_per_token
from moefold.train.loss import build_objective
from moefold.train.trainer import Trainer

VOCAB = 64
MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm}
"""What the projections, experts and heads run as. The attention core is counted apart: on CPU
SDPA's fused kernel is not counted at all and its math path is counted as dense bmm."""


def attended_pairs(seq_len: int, window: int) -> int:
    """(query, key) pairs a causal mask admits, of the W latest keys when window > 0."""
    return sum(min(i + 1, window or seq_len) for i in range(seq_len))


def counted_flops_per_token(preset: str, overrides: dict[str, str], batch: int = 2) -> tuple[int, float]:
    """(the convention's count, an independent one) per token of one training step of `preset`."""
    cfg = load_config(preset, {"moe.experts_backend": "loop", **overrides})  # loop: plain mm per expert
    torch.manual_seed(0)
    model = build_model(cfg, VOCAB)
    model.init_weights(seed=1)
    m, S = cfg.model, cfg.train.seq_len
    ids_BS1 = torch.randint(0, VOCAB, (batch, S + 1), generator=torch.Generator().manual_seed(2))
    with FlopCounterMode(display=False) as counter:
        total, _ = build_objective(model)(model, ids_BS1[:, :-1], ids_BS1[:, 1:])
        total.backward()
    matmuls = sum(n for op, n in counter.get_flop_counts()["Global"].items() if op in MATMULS)
    # 2 FLOPs a multiply-add, forward and two backward GEMMs; the diagonal counts half, as the
    # convention's S²/2 triangle has it
    qk_v = (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim if m.attention == "mla"
            else 2 * (m.head_dim or m.dim // m.n_heads))
    pairs = attended_pairs(S, m.sliding_window) - S / 2
    attention_per_token = 6 * (m.n_layers + m.mtp_layers) * m.n_heads * qk_v * pairs / S
    vectors = sum(p.numel() for p in model.parameters() if p.dim() == 1)  # norms: in the convention
    independent = matmuls / (batch * S) + attention_per_token + 6 * vectors
    return train_flops_per_token(model, S), independent


@pytest.mark.parametrize("preset, overrides", [
    ("tiny-qwen3", {}),
    ("tiny-deepseek", {}),  # MLA, dense first layer, shared expert, MTP (its head use included)
    ("tiny-mixtral", {"model.sliding_window": "128"}),  # a window as long as the sequence
    ("tiny-mixtral", {}),  # 64 keys of 128
    ("tiny-mixtral", {"model.sliding_window": "16"}),
], ids=["qwen3", "deepseek", "mixtral-full-window", "mixtral-window-64", "mixtral-window-16"])
def test_flops_per_token_match_the_counted_matmuls_and_attended_pairs(preset, overrides):
    """Routed experts count the K of E they run, and attention the keys the mask lets a query see:
    a sliding window was counted as all S keys (tiny-mixtral: 4.5% more FLOPs than it runs, MFU
    too high; a 4,096 window at S = 32,768 over four times the attention it runs)."""
    convention, independent = counted_flops_per_token(preset, {"model.vocab_size": str(VOCAB), **overrides})
    # the band's area is (S − W)/2 pairs a layer off its staircase of cells: under 0.2% here, where
    # counting all S keys is 4.5% (W = 64) and 16% (W = 16) off
    assert convention == pytest.approx(independent, rel=3e-3)


@pytest.mark.parametrize("name, datasheet", [
    ("NVIDIA H100 80GB HBM3", 989.0),  # SXM
    ("NVIDIA H100 PCIe", 756.0),  # 1,513 with sparsity
    ("NVIDIA H100 NVL", 835.5),  # 1,671 with sparsity
    ("NVIDIA H200", 989.0),
    ("NVIDIA H200 NVL", 835.5),  # 1,671 with sparsity
    ("NVIDIA H800 PCIe", 756.0),
    ("NVIDIA H20", 148.0),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA B200", 2250.0),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_mfu_divides_by_the_datasheet_peak_of_the_card(monkeypatch, name, datasheet):
    """The PCIe and NVL cards of a family have lower clocks than its SXM one: an H100 PCIe was
    taken for an SXM (989), which put its MFU at 0.76 of the true one."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_tflops(torch.device("cuda"), configured=0.0) == datasheet
    assert peak_tflops(torch.device("cuda"), configured=123.0) == 123.0  # logging.peak_tflops wins
    assert peak_tflops(torch.device("cpu"), configured=0.0) is None
    assert all(value > 0 for value in PEAK_BF16_TFLOPS.values())


class LargestTensor(TorchDispatchMode):
    """The most elements any op's output held while the mode was on."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("chunk", [0, 24, 1000])  # plain head; 24 tokens, the last chunk short; one chunk
def test_validation_takes_the_loss_in_chunks_as_training_does(tmp_path, text_corpus, chunk):
    """train.loss_chunk_tokens promises a run never holds the whole [tokens, vocabulary] logits, but
    validation ran the plain head over the validation micro-batch (logits, their fp32 copy and log
    softmax: 10 bytes a token and vocabulary entry, 25 GB for 16k tokens of Qwen3's vocabulary)
    where training had fit. Now it takes the run's head loss, and the value stays the token mean."""
    cfg = load_config(None, {**TINY_OVERRIDES, "data.path": str(text_corpus), "train.steps": "1",
                             "train.warmup_steps": "0", "train.val_batches": "2",
                             "train.loss_chunk_tokens": str(chunk)})
    trainer = Trainer(cfg, tmp_path / "run", out=lambda line: None)
    first, second = trainer.val_batches[:2]
    labels_BS = second.labels_BS.clone()
    labels_BS[1:, 5:] = IGNORE_INDEX  # batches of unequal label counts
    trainer.val_batches = [first, dataclasses.replace(second, labels_BS=labels_BS)]
    with torch.no_grad():
        trainer.model.eval()
        per_token = [F.cross_entropy(trainer.model(b.input_ids_BS).flatten(0, 1).double(), b.labels_BS.flatten(),
                                     reduction="sum", ignore_index=IGNORE_INDEX) for b in trainer.val_batches]
        labelled = sum(int((b.labels_BS != IGNORE_INDEX).sum()) for b in trainer.val_batches)
        trainer.model.train()
    with LargestTensor() as largest:
        val_loss = trainer.validate()
    assert val_loss == pytest.approx((sum(per_token) / labelled).item(), rel=1e-5)
    T, V = first.input_ids_BS.numel(), trainer.vocab_size
    assert (largest.numel >= T * V) == (chunk == 0 or chunk >= T)  # all logits at once: one chunk of all
