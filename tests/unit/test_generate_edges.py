"""Edges of `moefold generate` and `moefold.generate.sample`: input the command line must refuse in
one line (exit 2, no traceback), models `sample` cannot generate from consistently, where
generation stops and how its text prints."""

import pytest
import torch

from moefold.cli import main
from moefold.config import load_config
from moefold.errors import UserError
from moefold.generate import sample
from moefold.models.transformer import build_model


@pytest.fixture
def finished_run(tmp_path, tiny_args):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2", "--train.warmup_steps", "1"]) == 0
    return run


def test_a_prompt_that_is_not_utf8_is_a_one_line_error(finished_run, capsys):
    """Bytes that are not UTF-8 on the command line reach Python as lone surrogates (PEP 383),
    which no tokenizer encodes: the byte tokenizer's str.encode raised UnicodeEncodeError, a
    traceback and exit 1."""
    capsys.readouterr()
    assert main(["generate", "--run-dir", str(finished_run), "--prompt", "caf\udce9 au lait"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "--prompt" in err and "UTF-8" in err and "byte 0xe9" in err, err


def _tiny_qwen3(overrides: dict[str, str]):
    cfg = load_config("tiny-qwen3", {"moe.experts_backend": "loop", **overrides})
    model = build_model(cfg, 97).eval()
    model.init_weights(0)
    with torch.no_grad():  # sharper logits than init_std's, so a changed context changes the picks
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8)
    return model


def _greedy_by_full_forwards(model, prompt_ids: list[int], max_new_tokens: int, context: int) -> list[int]:
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int(model(torch.tensor([ids[-context:]]))[0, -1].argmax()))
    return ids[len(prompt_ids):]


def test_sampling_from_a_model_that_drops_tokens_is_refused():
    """With a capacity factor a token's expert output depends on what else its forward reads: the
    cache reads the prompt at once (drops at its capacity) and then one token at a time (never a
    drop: C = min(T, ceil(factor·K/E)) = 1), so `sample` picked other tokens than full forwards of
    the same context (16 of 20 here) and than the dropless model `moefold generate` builds. It
    now refuses, naming the option; the dropless model with the same weights generates as full
    forwards do."""
    dropping = _tiny_qwen3({"moe.capacity_factor": "1.0"})
    with pytest.raises(UserError, match=r"^sample: the model drops tokens past its experts' capacity "
                                        r"\(moe.capacity_factor=1.0\)"):
        sample(dropping, [3, 10, 17, 24, 31], 20, 0.0, 0, 9, -1, torch.Generator())
    dropless = _tiny_qwen3({})
    dropless.load_state_dict(dropping.state_dict())
    assert (sample(dropless, [3, 10, 17, 24, 31], 20, 0.0, 0, 9, -1, torch.Generator())
            == _greedy_by_full_forwards(dropless, [3, 10, 17, 24, 31], 20, 9))


def test_generation_stops_at_the_end_of_document_id_the_run_trained_with(tmp_path, tiny_args, monkeypatch):
    """A run on token files with data.eos_id ended its documents with that id; `moefold generate`
    passed `sample` the tokenizer's EOS instead (the byte tokenizer's 256), so it never stopped
    where the model ends a document and printed past it."""
    import numpy as np

    import moefold.generate

    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(11, 200, size=int(n)), 10) for n in rng.integers(20, 60, size=80)]
    np.save(tmp_path / "tokens.npy", np.concatenate(docs).astype(np.uint16))
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--data.path", str(tmp_path / "tokens.npy"),
                 "--data.eos_id", "10", "--train.steps", "2", "--train.warmup_steps", "1"]) == 0
    given = {}

    def recording_sample(model, prompt_ids, max_new_tokens, temperature, top_k, context, eos_id, *args):
        given["eos_id"] = eos_id
        return []

    monkeypatch.setattr(moefold.generate, "sample", recording_sample)
    assert main(["generate", "--run-dir", str(run), "--prompt", "x", "--max-new-tokens", "3"]) == 0
    assert given == {"eos_id": [10]}  # with no imported checkpoint's ids (stop_ids)


def test_text_that_stdout_cannot_encode_prints_replaced_not_a_traceback(finished_run, monkeypatch):
    """Generated text is any Unicode (U+FFFD for bytes that are not UTF-8, the prompt's own
    characters); print to a stdout of another encoding (a Latin-1 locale, cp1252 when Windows
    redirects to a file, PYTHONIOENCODING=ascii) raised UnicodeEncodeError, a traceback, after
    the whole generation. Characters it cannot encode now print as '?'."""
    import io
    import sys

    latin1 = io.TextIOWrapper(io.BytesIO(), encoding="latin-1")
    monkeypatch.setattr(sys, "stdout", latin1)
    assert main(["generate", "--run-dir", str(finished_run), "--prompt", "naïve €5", "--max-new-tokens", "0"]) == 0
    latin1.flush()
    assert latin1.buffer.getvalue().decode("latin-1") == "naïve ?5\n"


def test_sampling_from_a_model_that_routes_round_robin_is_refused(tmp_path, tiny_args, capsys):
    """moe.force_balanced (benchmarks) sends token t of a forward to experts (t·K + k) mod E,
    whatever the router says: the cache reads each new token alone (t = 0, always the first
    experts), so `sample` picked other tokens than full forwards of the same context (19 of 20
    here), silently. `sample` now refuses, and `moefold generate` of such a run says so in one
    line (exit 2)."""
    balanced = _tiny_qwen3({"moe.force_balanced": "true"})
    with pytest.raises(UserError, match=r"^sample: the model routes tokens round-robin .*moe.force_balanced=true"):
        sample(balanced, [3, 10, 17, 24, 31], 20, 0.0, 0, 9, -1, torch.Generator())
    routed = _tiny_qwen3({})
    routed.load_state_dict(balanced.state_dict())
    assert (sample(routed, [3, 10, 17, 24, 31], 20, 0.0, 0, 9, -1, torch.Generator())
            == _greedy_by_full_forwards(routed, [3, 10, 17, 24, 31], 20, 9))
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "1", "--train.warmup_steps", "0",
                 "--moe.force_balanced", "true"]) == 0
    capsys.readouterr()
    assert main(["generate", "--run-dir", str(run), "--prompt", "ab", "--max-new-tokens", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "moe.force_balanced=true" in err, err


@pytest.mark.parametrize("bad_id", [-1, 1 << 20])
def test_a_prompt_id_outside_the_vocabulary_is_refused_by_name(bad_id):
    """An id the embedding has no row for ended in torch's IndexError from inside the model (on a
    GPU, a device-side assert that leaves the CUDA context unusable); it is refused up front."""
    model = _tiny_qwen3({})
    with pytest.raises(UserError, match=rf"^sample: prompt_ids holds {bad_id}, outside the model's "
                                        rf"vocabulary \[0, {model.vocab_size}\)$"):
        sample(model, [3, bad_id, 5], 4, 0.0, 0, 9, -1, torch.Generator())
    last = model.vocab_size - 1  # the edge is still a token
    assert len(sample(model, [3, last], 2, 0.0, 0, 9, -1, torch.Generator())) == 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_model_whose_logits_hold_nan_is_refused(temperature):
    """A diverged checkpoint (a NaN in the output head) made greedy decoding return the NaN's
    index as if it were a token, and sampling end in torch.multinomial's traceback; both are now
    one UserError saying the logits hold NaN."""
    model = _tiny_qwen3({})
    with torch.no_grad():
        model.output.weight[7, 0] = float("nan")
    with pytest.raises(UserError, match=r"^sample: the model's next-token logits hold NaN \(1 of \d+\)"):
        sample(model, [3, 10, 17], 4, temperature, 0, 9, -1, torch.Generator().manual_seed(0))
