"""Generation's inputs read once and safely: a prompt's encoding changes no other encoding running
at the same time, `moefold generate` judges the checkpoint whose weights it loaded, and builds (as
`convert --to-hf` exports) the model with the config that checkpoint was saved with."""

import threading
from pathlib import Path

import pytest
import torch

tokenizers = pytest.importorskip("tokenizers")

from moefold.data.tokenizer import HFTokenizer  # noqa: E402

_SPECIALS = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|im_start|>"]


def _tokenizer_json(path) -> str:
    """A byte-level BPE whose post-processor adds a BOS, with a chat token: a prompt's encoding
    differs from a document's in both (`encode_prompt`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(["hello world the experts route tokens"] * 20,
                                  trainers.BpeTrainer(vocab_size=300, special_tokens=_SPECIALS,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(path))
    return str(path)


def test_prompts_and_documents_encoded_in_threads_get_their_serial_ids(tmp_path):
    """encode_prompt switched the shared tokenizer's encode_special_tokens off for its call and
    back on after: a document encoded meanwhile in another thread read '<|im_start|>' as the chat
    token (577 of 600 such encodes, 2 threads of each), and a prompt whose call began before
    another prompt's ended could read it as text."""
    tokenizer = HFTokenizer(_tokenizer_json(tmp_path / "tokenizer.json"))
    document, prompt = "hello <|im_start|> world " * 200, "<|im_start|>hello world " * 200
    serial = {"document": tokenizer.encode(document), "prompt": tokenizer.encode_prompt(prompt)}
    assert serial["document"] != tokenizer.encode_prompt(document)  # the two encodings differ here
    encode = {"document": lambda: tokenizer.encode(document), "prompt": lambda: tokenizer.encode_prompt(prompt)}
    wrong = {"document": 0, "prompt": 0}

    def run(kind: str) -> None:
        for _ in range(150):
            wrong[kind] += encode[kind]() != serial[kind]
    threads = [threading.Thread(target=run, args=(kind,)) for kind in ("document", "prompt") * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == {"document": 0, "prompt": 0}


@pytest.mark.parametrize("command", ["generate", "convert"])
def test_generate_and_convert_judge_the_checkpoint_whose_weights_they_loaded(tmp_path, tiny_args, monkeypatch,
                                                                             command):
    """`moefold generate` and `convert --to-hf` resolved the run's latest checkpoint twice: for the
    weights, then again for the stop ids or the export's eos_token_id (whether its model ever read
    an end of document: not at step 0). A training that saved a checkpoint in between had them
    judged by that one: step 3 where the weights were step 2's. Now the one path serves both."""
    import shutil

    import moefold.generate as generate
    from moefold.cli import main

    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2",
                 "--train.warmup_steps", "1"]) == 0
    loaded, judged = [], []
    load_weights, checkpoint_step = generate.load_weights, generate.checkpoint_step

    def load_then_save_another(model, path, *args):
        load_weights(model, path, *args)
        loaded.append(path.name)
        shutil.copytree(path, path.with_name("step_00000003"))  # as a training's save meanwhile

    def step_of(path):
        judged.append(Path(path).name)
        return checkpoint_step(path)
    monkeypatch.setattr(generate, "load_weights", load_then_save_another)
    monkeypatch.setattr(generate, "checkpoint_step", step_of)
    output = (["--prompt", "hello", "--max-new-tokens", "2", "--device", "cpu"] if command == "generate"
              else ["--to-hf", str(tmp_path / "hf")])
    assert main([command, "--run-dir", str(run), *output]) == 0
    assert loaded == ["step_00000002"]
    assert judged == loaded


class _Killed(BaseException):
    """The resume's process killed before its first save (SIGKILL, an out-of-memory kill)."""


def _run_then_resume_with_top_k_3_killed_before_saving(tmp_path, tiny_args, monkeypatch) -> Path:
    """A run of moe.top_k 2 to step 2, then `--resume --moe.top_k 3`, which rewrites config.toml as
    it starts and is killed before its first save: config.toml holds top_k 3, the run's latest
    (and only) checkpoint the top_k-2 model."""
    import moefold.train.trainer as trainer
    from moefold.cli import main
    from moefold.config import read_run_config

    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2",
                 "--train.warmup_steps", "1"]) == 0

    def killed(*args, **kwargs):
        raise _Killed()
    with monkeypatch.context() as patch:
        patch.setattr(trainer, "save_checkpoint", killed)
        with pytest.raises(_Killed):
            main(["train", "--resume", str(run), "--train.steps", "4", "--moe.top_k", "3"])
    assert read_run_config(run / "config.toml")[0].moe.top_k == 3
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]
    return run


def _reference_model(text_corpus, checkpoint):
    """The model `checkpoint` holds, built from the options its run trained with (moe.top_k 2,
    given here, not read back from the run) and its weights loaded directly."""
    from conftest import TINY_OVERRIDES

    from moefold.checkpoint.dcp import load_weights
    from moefold.config import load_config
    from moefold.models.transformer import build_model

    cfg = load_config(None, {**TINY_OVERRIDES, "data.path": str(text_corpus), "train.steps": "2",
                             "train.warmup_steps": "1", "moe.capacity_factor": "0"})
    assert cfg.moe.top_k == 2
    model = build_model(cfg, 257)
    load_weights(model, checkpoint)
    return model.eval()


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).float()


def test_generate_builds_the_model_its_checkpoint_was_saved_with(tmp_path, tiny_args, text_corpus, monkeypatch,
                                                                 capsys, sampled_models):
    """generate built its model from config.toml, which a resume rewrites as it starts: after a
    `--resume --moe.top_k 3` killed before its first save, it ran the step-2 weights of a top_k-2
    model as top_k 3, printing that model's text (exit 0). Now the config the checkpoint was saved
    with: logits equal to a top_k-2 model's with those weights, loaded directly, and its text."""
    import moefold.generate as generate
    from moefold.cli import main
    from moefold.data.tokenizer import build_tokenizer

    run = _run_then_resume_with_top_k_3_killed_before_saving(tmp_path, tiny_args, monkeypatch)
    reference = _reference_model(text_corpus, run / "checkpoints" / "step_00000002")
    ids = list(b"the experts route tokens")
    capsys.readouterr()
    assert main(["generate", "--run-dir", str(run), "--prompt", "the experts", "--max-new-tokens", "8",
                 "--temperature", "0", "--device", "cpu"]) == 0
    [model] = sampled_models
    assert torch.equal(_logits(model, ids), _logits(reference, ids))
    tokenizer = build_tokenizer("")
    prompt_ids = tokenizer.encode_prompt("the experts")
    new_ids = generate.sample(reference, prompt_ids, 8, 0.0, 0, 32, tokenizer.eos_id, torch.Generator(), 257)
    assert capsys.readouterr().out == generate.continuation(tokenizer, "the experts", prompt_ids, new_ids) + "\n"
    # From Python too, the latest checkpoint or one named.
    for checkpoint in (None, run / "checkpoints" / "step_00000002"):
        model, _, cfg = generate.load_model_from_run(run, "cpu", checkpoint=checkpoint)
        assert cfg.moe.top_k == 2
        assert torch.equal(_logits(model, ids), _logits(reference, ids))


def test_convert_to_hf_exports_the_model_its_checkpoint_was_saved_with(tmp_path, tiny_args, text_corpus,
                                                                       monkeypatch):
    """convert --to-hf built its model from config.toml too: the export of step 2's top_k-2
    weights stated num_experts_per_tok 3 in config.json, a model transformers runs otherwise."""
    import json

    from moefold.cli import main

    run = _run_then_resume_with_top_k_3_killed_before_saving(tmp_path, tiny_args, monkeypatch)
    assert main(["convert", "--run-dir", str(run), "--to-hf", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_experts_per_tok"] == 2


def test_generate_takes_data_tokenizer_from_config_toml_as_its_refusal_says(tmp_path, tiny_args, capsys):
    """The model is the checkpoint's config's, but data.tokenizer stays config.toml's, where the
    refusal of a run on token files without their tokenizer says to set it: the checkpoint's
    config (tokenizer '') must not undo that edit. Generated text is then the tokenizer's words."""
    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers

    from moefold.cli import main
    from moefold.config import read_run_config, to_toml
    from moefold.checkpoint.run_config import saved_config

    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(11, 1000, size=int(n)), 10) for n in rng.integers(20, 60, size=80)]
    np.save(tmp_path / "tokens.npy", np.concatenate(docs).astype(np.uint16))
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--data.path", str(tmp_path / "tokens.npy"),
                 "--data.eos_id", "10", "--model.vocab_size", "1000", "--train.steps", "1",
                 "--train.warmup_steps", "1"]) == 0
    generate = ["generate", "--run-dir", str(run), "--prompt", "t5 t17", "--max-new-tokens", "4",
                "--temperature", "0", "--device", "cpu"]
    capsys.readouterr()
    assert main(generate) == 2
    assert "set data.tokenizer in its config.toml" in capsys.readouterr().err
    words = Tokenizer(models.WordLevel({"<|endoftext|>" if i == 10 else f"t{i}": i for i in range(1000)},
                                       unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(tmp_path / "words.json"))
    cfg, _ = read_run_config(run / "config.toml")
    cfg.data.tokenizer = str(tmp_path / "words.json")
    (run / "config.toml").write_text(to_toml(cfg))
    assert saved_config(run / "checkpoints" / "step_00000001")[0].data.tokenizer == ""
    assert main(generate) == 0
    out = capsys.readouterr().out.split()
    assert out[:2] == ["t5", "t17"] and len(out) > 2
    assert all(word.startswith("t") for word in out), out
