"""Generation's inputs read once and safely: a prompt's encoding changes no other encoding running
at the same time, and `moefold generate` judges the checkpoint whose weights it loaded."""

import threading
from pathlib import Path

import pytest

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


def test_generate_judges_the_checkpoint_whose_weights_it_loaded(tmp_path, tiny_args, monkeypatch):
    """`moefold generate` resolved the run's latest checkpoint twice: for the weights, then again
    for the stop ids (whether its model ever read an end of document: not at step 0). A training
    that saved a checkpoint in between had the stop ids judged by that one: step 3 where the
    weights were step 2's. Now the one path serves both."""
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
    assert main(["generate", "--run-dir", str(run), "--prompt", "hello", "--max-new-tokens", "2",
                 "--device", "cpu"]) == 0
    assert loaded == ["step_00000002"]
    assert judged == loaded
