"""`moefold generate` against transformers: the context a run converted from a Hugging Face
checkpoint reads (its max_position_embeddings, not train.seq_len), a prompt longer than it, and
a run trained on token files without the tokenizer that made them."""

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_interop import hf_model_of, qwen3  # noqa: E402

from moefold.cli import main  # noqa: E402
from moefold.data.tokenizer import ByteTokenizer  # noqa: E402


def _converted_run(tmp_path, **hf_config):
    """A tiny random Qwen3-MoE of 300 ids (the byte tokenizer's 257 fit) converted to a run
    (train.seq_len 256, moefold's default), and the transformers model it came from."""
    reference = hf_model_of(qwen3(vocab_size=300, **hf_config))
    reference.save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(run)]) == 0
    return run, reference


def _greedy(args, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["generate", *args, "--temperature", "0", "--device", "cpu"])
    out, err = capsys.readouterr()
    return code, out, err


def _prompt(n: int) -> str:
    letters = np.random.default_rng(n).integers(0, 26, size=n)  # aperiodic: any dropped token counts
    return "".join(chr(ord("a") + int(i)) for i in letters)


def test_a_prompt_longer_than_train_seq_len_is_read_whole_as_transformers_reads_it(tmp_path, capsys):
    """A converted run's train.seq_len is moefold's default 256, not the model's context (config.json's
    max_position_embeddings, 512 here): generate read only the prompt's last 256 tokens, silently,
    and continued 300 bytes otherwise than transformers' greedy generate."""
    run, reference = _converted_run(tmp_path, max_position_embeddings=512)
    prompt = _prompt(300)
    code, out, err = _greedy(["--run-dir", str(run), "--prompt", prompt, "--max-new-tokens", "12"], capsys)
    assert code == 0, err
    prompt_ids = ByteTokenizer().encode(prompt)
    with torch.no_grad():
        hf_ids = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=False,
                                    eos_token_id=256, pad_token_id=0,  # ids past the tokenizer's: never
                                    suppress_tokens=list(range(257, 300)))[0, len(prompt_ids):].tolist()
    new_ids = hf_ids[:hf_ids.index(256)] if 256 in hf_ids else hf_ids
    assert out == ByteTokenizer().decode(prompt_ids + new_ids) + "\n"


def test_a_prompt_longer_than_the_models_context_is_refused_in_one_line(tmp_path, capsys):
    """transformers never drops prompt tokens; generate dropped the first 24 of 88 silently."""
    run, _ = _converted_run(tmp_path, max_position_embeddings=64)
    code, out, err = _greedy(["--run-dir", str(run), "--prompt", _prompt(88), "--max-new-tokens", "4"], capsys)
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        "moefold: error: --prompt is 88 tokens, more than the model's context of 64 "
        "(model.max_position_embeddings); shorten it"]


def test_generation_past_the_models_context_slides_its_window(tmp_path, capsys):
    """Past the context, each token is read with the `context` tokens that end with it at positions
    0.. (as without a cache): the model's 64 here, where it was train.seq_len's 256."""
    run, reference = _converted_run(tmp_path, max_position_embeddings=64)
    prompt = _prompt(50)
    code, out, err = _greedy(["--run-dir", str(run), "--prompt", prompt, "--max-new-tokens", "40"], capsys)
    assert code == 0, err
    ids = ByteTokenizer().encode(prompt)
    with torch.no_grad():
        for _ in range(40):
            next_id = int(reference(torch.tensor([ids[-64:]])).logits[0, -1, :257].argmax())
            if next_id == 256:
                break
            ids.append(next_id)
    assert out == ByteTokenizer().decode(ids) + "\n"


def test_the_kv_cache_holds_what_the_sequence_needs_not_the_whole_context():
    """A context of 40960 positions (a Qwen3's) was allocated whole for a prompt of 3 tokens and 4
    new ones: 5,900 times the keys and values needed."""
    from moefold.config import load_config
    from moefold.generate import sample
    from moefold.models.transformer import build_model

    model = build_model(load_config("tiny-qwen3", {"moe.experts_backend": "loop"}), 97).eval()
    model.init_weights(0)
    capacities, new_cache = [], model.new_cache
    model.new_cache = lambda capacity: capacities.append(capacity) or new_cache(capacity)
    sample(model, [3, 10, 17], 4, 0.0, 0, 40960, -1, torch.Generator())
    assert capacities == [7]


@pytest.mark.parametrize("data_path", ["tokens.npy", "shards"])  # the file, or a directory of it
def test_a_run_on_token_files_without_their_tokenizer_is_refused(data_path, tmp_path, tiny_args, capsys):
    """Token files of a 1000-id tokenizer (model.vocab_size 1000) and no data.tokenizer: generate
    encoded --prompt as UTF-8 bytes, ids that mean other tokens there, and sampled only the byte
    tokenizer's first 257 rows, printing them as bytes (exit 0). Refused before the weights are read."""
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(11, 1000, size=int(n)), 10) for n in rng.integers(20, 60, size=80)]
    (tmp_path / "shards").mkdir()
    np.save(tmp_path / "shards" / "tokens.npy", np.concatenate(docs).astype(np.uint16))
    if data_path == "tokens.npy":
        (tmp_path / "shards" / "tokens.npy").rename(tmp_path / "tokens.npy")
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--data.path", str(tmp_path / data_path),
                 "--data.eos_id", "10", "--model.vocab_size", "1000", "--train.steps", "1",
                 "--train.warmup_steps", "1"]) == 0
    code, out, err = _greedy(["--run-dir", str(run), "--prompt", "x", "--max-new-tokens", "3"], capsys)
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        f"moefold: error: --run-dir {run}: trained on token files (data.path={tmp_path / data_path}) of "
        "1000 ids without their tokenizer: --prompt's bytes are not its tokens; set data.tokenizer in its "
        "config.toml to the tokenizer.json that made them"]


def _word_tokenizer(path, vocab_size: int, eos_id: int) -> None:
    """A tokenizer.json of words t0 t1 ... with <|endoftext|> at `eos_id`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {("<|endoftext|>" if i == eos_id else f"t{i}"): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    tokenizer.save(str(path))


def test_a_run_converted_at_step_0_stops_at_eos_where_transformers_generate_stops(tmp_path, capsys):
    """A converted run's checkpoint is step 0 but holds trained weights: generate must stop at the
    checkpoint's end of document (its tokenizer.json's, config.json's eos_token_id), as transformers'
    generate does with the config alone, not run on past it (export's step-0 rule is not generate's)."""
    from moefold.data.tokenizer import HFTokenizer
    from moefold.generate import continuation

    reference = hf_model_of(qwen3(vocab_size=96))
    prompt = "t5 t17 t3 t42"
    prompt_ids = [5, 17, 3, 42]
    with torch.no_grad():  # a later greedy token made the end of document: where both must stop
        free = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=10, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
    stop = next(j for j in range(2, 10) if free[j] not in free[:j] + prompt_ids)
    eos, free = free[stop], free[:stop + 1]
    reference.generation_config.eos_token_id = reference.config.eos_token_id = eos
    reference.save_pretrained(tmp_path / "hf")
    _word_tokenizer(tmp_path / "hf" / "tokenizer.json", 96, eos)
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(run)]) == 0
    code, out, err = _greedy(["--run-dir", str(run), "--prompt", prompt, "--max-new-tokens", "12"], capsys)
    assert code == 0, err
    with torch.no_grad():  # the config's eos_token_id, nothing passed
        hf_ids = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=False,
                                    pad_token_id=0)[0, 4:].tolist()
    assert hf_ids == free  # transformers stopped at it (and emitted it)
    tokenizer = HFTokenizer(str(tmp_path / "hf" / "tokenizer.json"))
    assert tokenizer.encode(prompt) == prompt_ids
    assert out == continuation(tokenizer, prompt, prompt_ids, free[:-1]) + "\n"


@pytest.mark.parametrize("prompt, message", [
    (_prompt(88), "--prompt is 88 tokens, more than the model's context of 64 (model.max_position_embeddings); "
                  "shorten it"),
    ("", "--prompt '' encodes to no tokens; give text to continue"),
])
def test_a_prompt_generate_refuses_is_refused_before_the_weights_are_read(prompt, message, tmp_path, capsys,
                                                                         monkeypatch):
    """The prompt is refused from config.toml and the tokenizer (as a tokenizer that does not fit
    is, ba150c6), not after the whole checkpoint was read into the model (a large one's minutes)."""
    import moefold.generate

    run, _ = _converted_run(tmp_path, max_position_embeddings=64)
    monkeypatch.setattr(moefold.generate, "load_weights", lambda *a, **k: pytest.fail("weights read"))
    code, out, err = _greedy(["--run-dir", str(run), "--prompt", prompt, "--max-new-tokens", "4"], capsys)
    assert (code, out, err.splitlines()) == (2, "", ["moefold: error: " + message])
