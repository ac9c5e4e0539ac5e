"""The training losses against `F.cross_entropy(ignore_index=-100)` in fp64: labels it refuses (negative
but not the ignore index, or past the vocabulary) are refused by every loss path, and the tokens the
mean divides by are its own, an all-ignored micro-batch included (0, with zero gradients, where its
mean is nan: Megatron-Core's max(tokens, 1)); and on data ranks, micro-batches and TP ranks the
chunked loss trains as the plain one in one process."""

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import write_text_corpus
from ranks import run_ranks
from torch import nn
from torch.distributed.tensor import DTensor

from moefold.config import load_config
from moefold.data import IGNORE_INDEX
from moefold.train.chunked_loss import chunked_linear_cross_entropy, fused_chunk_loss_and_grad
from moefold.train.loss import ChunkedLoss, LogitsLoss, build_head_loss

V, D = 11, 6
HAS_CXX = shutil.which("g++") is not None or shutil.which("c++") is not None
needs_cxx = pytest.mark.skipif(not HAS_CXX, reason="Inductor on the CPU needs a C++ compiler")


def _head_and_hidden(seed: int, B: int = 2, S: int = 9) -> tuple[nn.Linear, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    head = nn.Linear(D, V, bias=False, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=gen, dtype=torch.float64))
    return head, torch.randn(B, S, D, generator=gen, dtype=torch.float64, requires_grad=True)


def _labels(seed: int, B: int = 2, S: int = 9) -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


HEAD_LOSSES = {
    "plain": lambda: LogitsLoss(),
    "chunked": lambda: ChunkedLoss(4),
    "chunked-fused": lambda: ChunkedLoss(4, fused_chunk_loss_and_grad),
    "plain-compiled": lambda: build_head_loss(0, compiled=True),
    "chunked-compiled": lambda: build_head_loss(4, compiled=True),
}
COMPILED = {"plain-compiled", "chunked-compiled"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=needs_cxx) if p in COMPILED else p for p in HEAD_LOSSES])
@pytest.mark.parametrize("bad", [-1, -5, -101, V, V + 3])
def test_a_label_cross_entropy_refuses_is_refused_by_every_loss(path, bad):
    """F.cross_entropy refuses a label outside [0, V) other than -100 (CPU raises, CUDA asserts on
    the device); the chunked loss took a negative one as label 0, silently."""
    head, h_BSD = _head_and_hidden(0)
    labels_BS = _labels(1)
    labels_BS[1, 6] = bad  # in the second chunk of 4
    with pytest.raises(IndexError):
        F.cross_entropy(head(h_BSD).flatten(0, 1), labels_BS.flatten(), ignore_index=IGNORE_INDEX)
    with pytest.raises((IndexError, RuntimeError), match="out of bounds|label"):
        HEAD_LOSSES[path]()(head, h_BSD, labels_BS).backward()


@pytest.mark.parametrize("bad", [-7, V])
def test_the_chunked_evaluation_loss_refuses_them_too(bad):
    head, h_BSD = _head_and_hidden(2)
    labels_BS = _labels(3)
    labels_BS[0, 0] = bad
    with torch.no_grad(), pytest.raises(RuntimeError, match=rf"label.*\[0, {V}\).*-100"):
        chunked_linear_cross_entropy(h_BSD, head.weight, labels_BS, 4)


@pytest.mark.parametrize("path", ["plain", "chunked", "chunked-fused"])
@pytest.mark.parametrize("ignored", ["none", "some", "a whole chunk", "all but one"])
def test_the_mean_divides_by_cross_entropys_token_count(path, ignored):
    """fp64: loss and gradients of the mean equal F.cross_entropy(reduction='mean')'s, and the
    loss times the labelled tokens its reduction='sum'."""
    head, h_BSD = _head_and_hidden(4)
    labels_BS = _labels(5)
    if ignored == "some":
        labels_BS[0, ::3] = IGNORE_INDEX
    elif ignored == "a whole chunk":
        labels_BS.view(-1)[4:8] = IGNORE_INDEX
    elif ignored == "all but one":
        labels_BS.fill_(IGNORE_INDEX)[1, 5] = 3
    h_ref_BSD = h_BSD.detach().clone().requires_grad_()
    head_ref = nn.Linear(D, V, bias=False, dtype=torch.float64)
    head_ref.load_state_dict(head.state_dict())
    logits_TV = head_ref(h_ref_BSD).flatten(0, 1)
    ref_mean = F.cross_entropy(logits_TV, labels_BS.flatten(), ignore_index=IGNORE_INDEX)
    ref_sum = F.cross_entropy(logits_TV, labels_BS.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    loss = HEAD_LOSSES[path]()(head, h_BSD, labels_BS)
    (1.3 * loss).backward()
    (1.3 * ref_mean).backward()
    tokens = (labels_BS != IGNORE_INDEX).sum()
    torch.testing.assert_close(loss, ref_mean, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(loss * tokens, ref_sum, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(h_BSD.grad, h_ref_BSD.grad, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(head.weight.grad, head_ref.weight.grad, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("path", ["plain", "chunked", "chunked-fused", pytest.param("plain-compiled", marks=needs_cxx),
                                  pytest.param("chunked-compiled", marks=needs_cxx)])
def test_an_all_ignored_micro_batch_gives_zero_loss_and_zero_gradients(path):
    """F.cross_entropy's sum is 0 and its mean nan (0 / 0); the objective's loss is 0 (the plain
    head's through loss_or_zero, the chunked loss itself), its gradients 0, not nan."""
    from moefold.models.mtp import loss_or_zero

    head, h_BSD = _head_and_hidden(6)
    labels_BS = torch.full((2, 9), IGNORE_INDEX)
    logits_TV = head(h_BSD).detach().flatten(0, 1)
    assert F.cross_entropy(logits_TV, labels_BS.flatten(), reduction="sum") == 0
    assert F.cross_entropy(logits_TV, labels_BS.flatten()).isnan()
    loss = loss_or_zero(HEAD_LOSSES[path]()(head, h_BSD, labels_BS), labels_BS)
    loss.backward()
    assert loss.item() == 0
    assert torch.equal(h_BSD.grad, torch.zeros_like(h_BSD))
    assert torch.equal(head.weight.grad, torch.zeros_like(head.weight))


@pytest.mark.parametrize("path", ["plain", "chunked", "chunked-fused"])
@pytest.mark.parametrize("grad", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("labels_shape, chunk", [((2, 6), 5), ((2, 6), 10), ((2, 4), 5), ((3, 3), 100)])
def test_labels_for_other_positions_than_the_hidden_states_are_refused(path, grad, labels_shape, chunk):
    """F.cross_entropy refuses a target count other than the logits' rows; the chunked loss, given
    more labels than positions in whole chunks (12 for 10 in chunks of 5 or 10), took the first
    ones and divided by all 12, silently."""
    head, h_BSD = _head_and_hidden(7, B=2, S=5)
    labels_BS = torch.randint(0, V, labels_shape, generator=torch.Generator().manual_seed(8))
    head_loss = {"plain": LogitsLoss(), "chunked": ChunkedLoss(chunk),
                 "chunked-fused": ChunkedLoss(chunk, fused_chunk_loss_and_grad)}[path]
    with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="batch_size|labels"):
        head_loss(head, h_BSD, labels_BS)


@pytest.mark.parametrize("path", ["plain", "chunked", "chunked-fused"])
@pytest.mark.parametrize("grad", [True, False], ids=["train", "eval"])
def test_an_empty_batch_gives_zero_loss_and_zero_gradients(path, grad):
    """No positions at all (B = 0; the MoE layers pass an empty batch through): F.cross_entropy's
    mean is nan, the objective's loss 0 through loss_or_zero, with zero gradients; the chunked loss
    failed in training ('NoneType' object has no attribute 'to': no chunk made dW)."""
    from moefold.models.mtp import loss_or_zero

    head, h_BSD = _head_and_hidden(9, B=0, S=5)
    labels_BS = torch.zeros(0, 5, dtype=torch.long)
    with torch.set_grad_enabled(grad):
        loss = loss_or_zero(HEAD_LOSSES[path]()(head, h_BSD, labels_BS), labels_BS)
    assert loss.item() == 0 and loss.requires_grad == grad
    if grad:
        loss.backward()
        assert h_BSD.grad.shape == h_BSD.shape
        assert torch.equal(head.weight.grad, torch.zeros_like(head.weight))



# ----------------------------------------------------------------------------- across ranks

GLOBAL_MICRO_BATCH, STEPS = 4, 3


def _run_config(corpus: Path, chunk: int, dp: int, accum: int, **parallel: str):
    """tiny-deepseek (MTP depth 1, its head through the same loss) on a global batch of 4
    sequences a step, split over dp data ranks and accum micro-batches."""
    return load_config("tiny-deepseek", {
        "data.path": str(corpus), "train.seq_len": "16", "train.steps": str(STEPS), "train.warmup_steps": "1",
        "train.micro_batch_size": str(GLOBAL_MICRO_BATCH // dp // accum), "train.grad_accum": str(accum),
        "train.loss_chunk_tokens": str(chunk), "train.val_every": "0", "data.val_fraction": "0",
        "train.device": "cpu", "logging.tensorboard": "false", "logging.progress_bar": "false",
        "logging.expert_load_heatmap": "false", "checkpoint.save_at_end": "false",
        **{f"parallel.{key}": value for key, value in parallel.items()}})


def _train(cfg, run_dir: Path) -> dict:
    """Every step's loss parts (means over the data ranks, as logged) and the first step's
    gradients, whole."""
    from moefold.train.trainer import Trainer

    trainer, parts, grads = Trainer(cfg, run_dir, out=lambda line: None), [], None
    while trainer.step < cfg.train.steps:
        step_parts = trainer.accumulate_gradients()
        if grads is None:
            grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                     for name, p in trainer.model.named_parameters()}
        trainer.optimizer_step()
        trainer.step += 1
        parts.append({k: trainer.dist.mean_over_data(v.detach()).item() for k, v in step_parts.items()})
    return {"parts": parts, "grads": grads}


def _train_on_rank(rank: int, runs: list[tuple], out: Path) -> None:
    results = {name: _train(_run_config(corpus, chunk, dp, accum, **parallel), run_dir)
               for name, corpus, chunk, dp, accum, parallel, run_dir in runs}
    if rank == 0:
        torch.save(results, out)


# (name, data ranks of the 2, micro-batches a step, parallel sizes)
LAYOUTS = [("dp2-fsdp", 2, 1, {}), ("dp2-ddp", 2, 1, {"data_parallel": "ddp"}), ("dp2-fsdp-accum2", 2, 2, {}),
           ("tp2-sp", 1, 1, {"tp": "2"})]


def test_the_chunked_loss_on_data_ranks_and_micro_batches_trains_as_the_plain_loss_in_one_process(tmp_path):
    """The global batch's loss is the mean over its tokens whatever splits it (Megatron-Core's
    per-token loss; every packed micro-batch has the same labelled tokens, so the mean of the
    micro-batch means is that mean): the chunked head under FSDP (the root's head weight read
    outside the head's forward), ZeRO-1, gradient accumulation and sequence-parallel TP (the head
    replicated), on 2 gloo ranks, against the plain head in one process with the whole global
    batch in one micro-batch. Every step's lm_loss and mtp_loss, and the first step's gradients."""
    corpus = write_text_corpus(tmp_path / "corpus")
    reference = _train(_run_config(corpus, 0, 1, 1), tmp_path / "reference")
    runs = [(name, corpus, 7, dp, accum, parallel, tmp_path / name) for name, dp, accum, parallel in LAYOUTS]
    run_ranks(2, _train_on_rank, runs, tmp_path / "results.pt")
    results = torch.load(tmp_path / "results.pt")
    for name, *_ in LAYOUTS:
        for step, (parts, ref_parts) in enumerate(zip(results[name]["parts"], reference["parts"], strict=True)):
            assert parts.keys() == ref_parts.keys() == {"lm_loss", "mtp_loss"}
            for key, value in parts.items():
                assert value == pytest.approx(ref_parts[key], rel=1e-5), f"{name}: {key} at step {step}"
        assert results[name]["grads"].keys() == reference["grads"].keys()
        for param, grad in reference["grads"].items():
            torch.testing.assert_close(results[name]["grads"][param], grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, param=param: f"{name}: first-step gradient of {param}: {m}")
