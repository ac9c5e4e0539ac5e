"""A parallel run builds its model on the meta device and allocates it only once it is sharded:
each rank holds and fills its own pieces, and those are the one-process model's weights (the same
seed draws the same whole weights, or `--init-from-hf` reads the same checkpoint, and each rank
keeps its piece), for every layout.
"""

import math
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import write_text_corpus
from layouts import config
from ranks import run_ranks
from torch.distributed.tensor import DTensor

import moefold.checkpoint.hf as hf
import moefold.models.init as init
from moefold.checkpoint.hf import load_pretrained, save_pretrained
from moefold.data.tokenizer import build_tokenizer
from moefold.models.transformer import build_model
from moefold.train.trainer import Trainer

HF_VOCAB = {"model.vocab_size": str(build_tokenizer("").vocab_size)}  # config.json's, as the CLI sets it
TWO_EXPERTS = {"moe.num_experts": "2"}  # FSDP over 4 leaves two ranks no rows of the router's [2, D]

# World 4: (name, model, dp, parallel sizes, overrides, from a Hugging Face checkpoint): FSDP over
# TP shards (strided pieces) with a tied head; EP·ETP experts under FSDP over edp; ZeRO-1's
# replicated parameters with TP and EP; 3 experts a rank that FSDP cuts by dim 1 over edp 2
# (parallel.data.even_expert_shards), drawn and read; a DeepSeek checkpoint (MTP's copies of the shared tensors,
# the expert bias) loaded into FSDP·TP·EP pieces and a tied Qwen3 one into FSDP·TP pieces; and
# ranks holding no rows of a tensor, drawn and read.
LAYOUTS = [
    ("fsdp-dp2-tp2-tied", "qwen3", 2, dict(tp=2), {"model.tie_embeddings": "true"}, False),
    ("fsdp-tp2-etp2-ep2", "deepseek", 2, dict(tp=2, etp=2, ep=2), {}, False),
    ("ddp-tp2-ep2", "qwen3", 2, dict(tp=2, ep=2, data_parallel="ddp"), {}, False),
    ("fsdp-ep2-edp2-by-rows", "qwen3", 4, dict(ep=2), {"moe.num_experts": "6"}, False),
    ("hf-fsdp-ep2-edp2-by-rows", "qwen3", 4, dict(ep=2), {**HF_VOCAB, "moe.num_experts": "6"}, True),
    ("hf-fsdp-tp2-ep2", "deepseek", 2, dict(tp=2, ep=2), HF_VOCAB, True),
    ("hf-fsdp-dp2-tp2-tied", "qwen3", 2, dict(tp=2), {**HF_VOCAB, "model.tie_embeddings": "true"}, True),
    ("fsdp-dp4-2-experts", "qwen3", 4, dict(), TWO_EXPERTS, False),
    ("hf-fsdp-dp4-2-experts", "qwen3", 4, dict(), {**HF_VOCAB, **TWO_EXPERTS}, True),
]

# A model of ~107M parameters (429 MB in fp32), mostly experts, none larger than 16 MB.
LARGE = {"model.dim": "512", "model.n_layers": "8", "model.n_heads": "8", "model.head_dim": "64",
         "model.n_kv_heads": "4", "moe.num_experts": "16", "moe.expert_hidden": "512"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_text_corpus(tmp_path_factory.mktemp("corpus"))


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _write_hf_checkpoint(cfg, path: Path) -> Path:
    """A checkpoint of other weights than the run's seed draws, so that a run ignoring it fails."""
    model = build_model(cfg, cfg.model.vocab_size)
    model.init_weights(cfg.train.seed + 1)
    save_pretrained(model, path)
    return path


def _compare_with_one_process(rank: int, corpus: Path, root: Path, out: Path) -> None:
    mismatches = []
    for name, model, dp, parallel, overrides, from_hf in LAYOUTS:
        cfg = config(model, corpus, dp, extra=overrides, **parallel)
        hf_dir = root / f"hf-{name}" if from_hf else None
        trainer = Trainer(cfg, root / name, out=lambda line: None, init_from_hf=hf_dir)
        sharded = dict(trainer.model.named_parameters())
        if from_hf:
            reference = load_pretrained(hf_dir)
        else:
            reference = build_model(cfg, trainer.vocab_size)
            reference.init_weights(cfg.train.seed)
        expected = dict(reference.named_parameters())
        if sharded.keys() != expected.keys():
            mismatches.append(f"{name}: parameter names differ")
        for pname, p in expected.items():
            got = _whole(sharded[pname]) if pname in sharded else None
            if got is None or not torch.equal(got.detach().float(), p.detach().float()):
                mismatches.append(f"{name}: {pname}")
        tied = trainer.model.output.weight is trainer.model.tok_embeddings.weight
        if "model.tie_embeddings" in overrides and not tied:
            mismatches.append(f"{name}: the head is no longer tied to the embeddings")
        if not any(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in sharded.values()):
            mismatches.append(f"{name}: nothing is sharded")
    if rank == 0:
        torch.save(mismatches, out)


def test_sharded_model_starts_from_the_one_process_weights(corpus, tmp_path):
    for name, model, dp, _, overrides, from_hf in LAYOUTS:
        if from_hf:
            _write_hf_checkpoint(config(model, corpus, dp, extra=overrides), tmp_path / f"hf-{name}")
    out = tmp_path / "mismatches.pt"
    run_ranks(4, _compare_with_one_process, corpus, tmp_path, out)
    assert torch.load(out) == []


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _count_what_is_drawn_and_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Elements a rank draws for its seeded weights or reads from a checkpoint, counted in [0]."""
    count = [0]
    draw = init._draw_block
    counting = threading.Lock()  # blocks are drawn by a pool of threads

    def counted_draw(shape, *args, **kwargs):
        with counting:
            count[0] += math.prod(shape)
        return draw(shape, *args, **kwargs)

    reading = hf._reading

    @contextmanager
    def counted_reading(file_of):
        with reading(file_of) as read:
            def counted_read(name, box=None):
                t = read(name, box)
                count[0] += t.numel()
                return t
            yield counted_read

    monkeypatch.setattr(init, "_draw_block", counted_draw)
    monkeypatch.setattr(hf, "_reading", counted_reading)
    return count


def _build_and_measure(rank: int, corpus: Path, hf_dir: Path | None, cut: dict, root: Path, out: Path) -> None:
    cfg = config("qwen3", corpus, dp=4, extra={**LARGE, **HF_VOCAB, **cut["extra"]}, **cut["parallel"])
    with pytest.MonkeyPatch.context() as monkeypatch:
        touched = _count_what_is_drawn_and_read(monkeypatch)
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak resident size
        before = _rss_bytes("VmRSS")
        trainer = Trainer(cfg, root, out=lambda line: None, init_from_hf=hf_dir)
        growth = _rss_bytes("VmHWM") - before
    params = list(trainer.model.parameters())
    result = {"growth": growth, "model_bytes": sum(p.numel() * p.element_size() for p in params),
              "touched": touched[0], "model_elements": sum(p.numel() for p in params)}
    results = [None] * 4
    torch.distributed.all_gather_object(results, result)
    if rank == 0:
        torch.save(results, out)


# How FSDP over 4 ranks cuts the experts: by dim 0 (16 experts, 4 a rank), or, with 9 experts a
# rank of EP 2 that edp 2 cannot split evenly, by dim 1 (each rank holds half of every expert's rows).
CUTS = {"experts-by-dim-0": {"parallel": {}, "extra": {}},
        "experts-by-dim-1": {"parallel": {"ep": 2}, "extra": {"moe.num_experts": "18"}}}


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
@pytest.mark.parametrize("start, cut", [("seed", "experts-by-dim-0"), ("hf", "experts-by-dim-0"),
                                        ("hf", "experts-by-dim-1")])
def test_no_rank_allocates_draws_or_reads_the_whole_model(start, cut, corpus, tmp_path):
    """FSDP over 4 ranks: a rank's peak memory while the trainer builds grows by its quarter of the
    weights, their optimizer states and one weight's rows being drawn or read: well under the whole
    model, which a rank allocating the model before sharding it would exceed (as would one keeping
    the checkpoint's file mapped: its pages count as the process's memory). And a rank draws, or
    reads from the checkpoint, little more than its quarter of the weights' elements, where drawing
    or reading every weight whole and keeping its piece would touch all of them (and reading a
    rank's experts whole, where FSDP cuts their rows, half)."""
    hf_dir = None
    if start == "hf":
        cfg = config("qwen3", corpus, dp=4, extra={**LARGE, **HF_VOCAB, **CUTS[cut]["extra"]},
                     **CUTS[cut]["parallel"])
        hf_dir = _write_hf_checkpoint(cfg, tmp_path / "hf")
    out = tmp_path / "peak.pt"
    run_ranks(4, _build_and_measure, corpus, hf_dir, CUTS[cut], tmp_path / "run", out)
    for result in torch.load(out):
        assert result["model_bytes"] > 400e6
        assert result["growth"] < 0.4 * result["model_bytes"], result
        assert result["touched"] < 0.3 * result["model_elements"], result
