"""Audit of moefold.data's file handling and tokenization against independent readings: the json
module and NumPy for the formats, naive Python for packing and the split, transformers for the
tokenizer, the loader's global batch against every data-parallel split of it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from data_reading import BYTES, EOS, byte_doc, streams_of

from moefold.config import DataConfig
from moefold.data import build_token_streams
from moefold.data.formats import find_data_files


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# Symlinks: one file, one weight
# ---------------------------------------------------------------------------------------------


def test_a_symlinked_file_in_the_data_directory_is_read_once(tmp_path):
    """b.txt -> a.txt beside it, and sub/c.txt -> ../a.txt: a.txt's text was trained on three
    times. Files are deduplicated by resolved path, the first name in sorted order kept."""
    data = tmp_path / "data"
    _write(data / "a.txt", "alpha")
    _write(data / "z.txt", "omega")
    (data / "b.txt").symlink_to("a.txt")
    (data / "sub").mkdir()
    (data / "sub" / "c.txt").symlink_to(Path("..", "a.txt"))
    (data / "y.txt").symlink_to(data / "z.txt")  # absolute target: first name is the link
    assert [f.name for f in find_data_files(str(data))] == ["a.txt", "y.txt"]
    streams = streams_of(data, val_fraction=0.0)
    assert streams.train_N.tolist() == byte_doc("alpha") + byte_doc("omega")
    assert streams.train_docs == 2


def test_a_token_file_behind_a_symlink_is_read_once(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "a.npy", np.arange(10, dtype=np.uint16))
    (data / "b.npy").symlink_to("a.npy")
    streams = streams_of(data, val_fraction=0.0)
    assert streams.train_N.tolist() == list(range(10))


def test_a_file_reached_through_a_symlinked_directory_and_directly_is_read_once(tmp_path):
    """A symlinked directory whose target is outside data.path holds a link back to a file inside
    it: the directory walk deduplicated directories only."""
    data = tmp_path / "data"
    _write(data / "a.txt", "alpha")
    outside = tmp_path / "outside"
    _write(outside / "o.txt", "outer")
    (outside / "back.txt").symlink_to(data / "a.txt")
    (data / "more").symlink_to(outside, target_is_directory=True)
    assert [f.name for f in find_data_files(str(data))] == ["a.txt", "more/o.txt"]


def test_hidden_files_and_directories_under_data_path_are_not_data(tmp_path):
    """What `ls` shows is what trains, as Hugging Face datasets resolves a data directory: a
    Jupyter checkpoint copy (.ipynb_checkpoints/a-checkpoint.txt) gave a.txt double weight, and
    macOS's AppleDouble ._a.txt (binary metadata) trained as U+FFFD text. data.path itself may
    be hidden."""
    data = tmp_path / ".cache" / "data"
    _write(data / "a.txt", "alpha")
    _write(data / ".ipynb_checkpoints" / "a-checkpoint.txt", "alpha")
    (data / "._a.txt").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        ")
    _write(data / "sub" / ".draft.txt", "draft")
    _write(data / "sub" / "b.txt", "beta")
    assert [f.name for f in find_data_files(str(data))] == ["a.txt", "sub/b.txt"]
    expected = byte_doc("alpha") + byte_doc("beta")
    assert streams_of(data, val_fraction=0.0).train_N.tolist() == expected
    hidden = _write(tmp_path / ".only.txt", "hidden file named itself")
    assert streams_of(hidden, val_fraction=0.0).train_N.tolist() == byte_doc(hidden.read_text())


# ---------------------------------------------------------------------------------------------
# Formats against an independent reading of the same file
# ---------------------------------------------------------------------------------------------


def _single_doc_free(path: Path, **overrides):
    """Streams of `path` with no validation: the training stream is every document, in order."""
    return streams_of(path, val_fraction=0.0, **overrides)


def test_txt_reads_as_its_utf8_bytes(tmp_path):
    """A .txt file is one document: its bytes, undecodable ones as U+FFFD, CRLF kept."""
    raw = b"line one\r\nna\xc3\xafve \xff tail\n"
    (tmp_path / "a.txt").write_bytes(raw)
    expected = byte_doc(raw.decode("utf-8", errors="replace"))
    assert _single_doc_free(tmp_path / "a.txt").train_N.tolist() == expected


def test_jsonl_against_the_json_module(tmp_path):
    import json

    records = [{"text": "plain"}, {"text": "tab\tand \u2028 separator", "id": 3},
               {"text": None}, {"text": ""}, {"text": "emoji \U0001f916 and \\n literal"},
               {"other": 1, "text": "last wins", "text2": "x"}]
    lines = [json.dumps(r, ensure_ascii=i % 2 == 0) for i, r in enumerate(records)]
    raw = ("\ufeff" + lines[0] + "\r\n" + "\n".join(lines[1:3]) + "\n\n   \n"
           + "\n".join(lines[3:]) + "\n").encode("utf-8")
    (tmp_path / "a.jsonl").write_bytes(raw)
    texts = [json.loads(line)["text"] for line in raw.decode("utf-8-sig").split("\n")
             if line.strip()]
    expected = [t for text in texts if text for t in byte_doc(text)]
    assert _single_doc_free(tmp_path / "a.jsonl").train_N.tolist() == expected


def test_parquet_against_pyarrow(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"row {i} " + "é" * (i % 4) if i % 5 else None for i in range(30)] + ["", "end"]
    pq.write_table(pa.table({"id": list(range(32)), "text": texts}), tmp_path / "a.parquet",
                   row_group_size=7)
    column = pq.read_table(tmp_path / "a.parquet").column("text").to_pylist()
    expected = [t for text in column if text for t in byte_doc(text)]
    assert _single_doc_free(tmp_path / "a.parquet").train_N.tolist() == expected


@pytest.mark.parametrize("dtype", ["u1", "<u2", ">u2", "<i4", ">i4", "<u4", "<i8", "<u8", "i2"])
def test_npy_against_numpy(tmp_path, dtype):
    """Every integer dtype and byte order numpy.save writes, two files concatenated by name."""
    data = tmp_path / "data"
    data.mkdir()
    first, second = np.arange(0, 200, 3).astype(dtype), np.arange(250, 7, -2).astype(dtype)
    np.save(data / "b.npy", second)
    np.save(data / "a.npy", first)
    expected = np.concatenate([np.load(data / "a.npy"), np.load(data / "b.npy")]).tolist()
    streams = streams_of(data, val_fraction=0.1)
    assert streams.train_N.tolist() + streams.val_N.tolist() == expected
    assert len(streams.val_N) == round(len(expected) * 0.1)


@pytest.mark.parametrize("token_dtype", ["uint16", "uint32"])
def test_bin_against_numpy_fromfile(tmp_path, token_dtype):
    ids = np.array([5, 0, 256, 17, 255, 1, 256], dtype=token_dtype)
    ids.tofile(tmp_path / "a.bin")
    expected = np.fromfile(tmp_path / "a.bin", dtype=token_dtype).tolist()
    streams = _single_doc_free(tmp_path / "a.bin", token_dtype=token_dtype)
    assert streams.train_N.tolist() == expected == ids.tolist()


# ---------------------------------------------------------------------------------------------
# Packing and the split against naive Python
# ---------------------------------------------------------------------------------------------


def _naive_windows(stream: list[int], seq_len: int) -> list[list[int]]:
    """Sequence i: tokens i*S .. i*S+S inclusive, while a whole one fits."""
    windows, start = [], 0
    while start + seq_len + 1 <= len(stream):
        windows.append(stream[start:start + seq_len + 1])
        start += seq_len
    return windows


def _corpus_dir(tmp_path: Path, num_docs: int = 60) -> tuple[Path, dict[str, str]]:
    """Documents of random letters (no 8 bytes repeat across them, so a window tells where it is
    from) in a directory: .txt files and one .jsonl."""
    import json
    import random

    rng = random.Random(0)
    data = tmp_path / "data"
    docs = {}
    for i in range(num_docs // 2):
        text = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz ", k=rng.randrange(5, 60)))
        docs[f"t{i:02d}.txt"] = _write(data / f"t{i:02d}.txt", text).read_text()
    lines = []
    for i in range(num_docs - num_docs // 2):
        text = "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ.", k=rng.randrange(5, 60)))
        docs[f"z.jsonl:{i + 1}"] = text
        lines.append(json.dumps({"text": text}))
    _write(data / "z.jsonl", "\n".join(lines) + "\n")
    return data, docs


@pytest.mark.parametrize("seq_len", [1, 7, 16, 64])
def test_packing_against_a_naive_reference(tmp_path, seq_len):
    """Documents in name order, each followed by one EOS, packed back to back; windows overlap by
    one token; the remainder (N - 1) % S is dropped."""
    from moefold.data import PackedSequences, make_batch

    data, docs = _corpus_dir(tmp_path, 20)
    stream = [t for name in sorted(docs, key=lambda n: (n.split(":")[0], int(n.split(":")[1])
                                                        if ":" in n else 0))
              for t in byte_doc(docs[name])]
    streams = streams_of(data, val_fraction=0.0)
    assert streams.train_N.tolist() == stream
    sequences = PackedSequences(streams.train_N, seq_len)
    windows = _naive_windows(stream, seq_len)
    assert len(sequences) == len(windows)
    assert [sequences[i].tolist() for i in range(len(sequences))] == windows
    batch = make_batch(sequences.gather(range(len(windows))), streams.eos_id)
    for row, window in enumerate(windows):
        doc_ids, doc = [], 0
        for token in window[:-1]:
            doc_ids.append(doc)
            doc += token == EOS
        assert batch.doc_ids_BS[row].tolist() == doc_ids


@pytest.mark.parametrize("val_fraction", [0.1, 0.3, 0.5])
def test_the_split_is_by_name_hash_and_validation_never_reaches_training(tmp_path, val_fraction):
    import zlib

    from moefold.data import PackedSequences

    data, docs = _corpus_dir(tmp_path, 80)
    streams = streams_of(data, val_fraction=val_fraction)
    threshold = round(val_fraction * 10_000)
    order = sorted(docs, key=lambda n: (n.split(":")[0], int(n.split(":")[1]) if ":" in n else 0))
    held = [n for n in order if zlib.crc32(n.encode()) % 10_000 < threshold]
    kept = [n for n in order if n not in held]
    assert held and kept  # precondition: the hash gave both sides documents
    assert streams.val_N.tolist() == [t for n in held for t in byte_doc(docs[n])]
    assert streams.train_N.tolist() == [t for n in kept for t in byte_doc(docs[n])]
    assert (streams.train_docs, streams.val_docs) == (len(kept), len(held))
    seq_len = 8
    train = {tuple(w) for w in _naive_windows(streams.train_N.tolist(), seq_len)}
    val = PackedSequences(streams.val_N, seq_len, "validation")
    assert not any(tuple(val[i].tolist()) in train for i in range(len(val)))


def test_token_files_hold_out_their_tail_without_overlap(tmp_path):
    from moefold.data import PackedSequences

    ids_N = np.random.default_rng(0).integers(0, 257, 1000).astype(np.uint16)
    np.save(tmp_path / "a.npy", ids_N)
    streams = streams_of(tmp_path / "a.npy", val_fraction=0.05)
    assert streams.train_N.tolist() == ids_N[:950].tolist()
    assert streams.val_N.tolist() == ids_N[950:].tolist()
    train, val = PackedSequences(streams.train_N, 10), PackedSequences(streams.val_N, 10)
    assert {tuple(train[i].tolist()) for i in range(len(train))}.isdisjoint(
        tuple(val[i].tolist()) for i in range(len(val)))


# ---------------------------------------------------------------------------------------------
# The tokenizer against transformers
# ---------------------------------------------------------------------------------------------


TOKENIZER_TEXTS = ["hello world", "  leading spaces\n\n\tand tabs", "naïve café ∑ 日本語",
                   "def f(x):\n    return x ** 2\n", "a" * 50 + " 🤖", "\n", "ends with space "]


def _bpe_tokenizer_json(path: Path, kind: str) -> Path:
    """A small trained BPE tokenizer: GPT-2's byte level or SentencePiece's metaspace."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    if kind == "bytelevel":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet, special = pre_tokenizers.ByteLevel.alphabet(), ["<|endoftext|>"]
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
        alphabet, special = [], ["<unk>", "</s>"]
        tokenizer.model = models.BPE(unk_token="<unk>")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=alphabet)
    tokenizer.train_from_iterator(TOKENIZER_TEXTS * 20 + ["def return hello world café"] * 50,
                                  trainer)
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_hf_tokenizer_against_transformers(tmp_path, kind):
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from moefold.data import HFTokenizer

    path = _bpe_tokenizer_json(tmp_path / "tokenizer.json", kind)
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
    ours = HFTokenizer(str(path))
    eos = "<|endoftext|>" if kind == "bytelevel" else "</s>"
    assert ours.eos_id == reference.convert_tokens_to_ids(eos)
    assert ours.vocab_size == len(reference)
    expected = [reference.encode(text, add_special_tokens=False) for text in TOKENIZER_TEXTS]
    assert [ours.encode(text) for text in TOKENIZER_TEXTS] == expected
    assert [ids.tolist() for ids in ours.encode_batch_np(TOKENIZER_TEXTS)] == expected
    for ids in expected:
        assert ours.decode(ids + [ours.eos_id]) == reference.decode(ids + [ours.eos_id],
                                                                    skip_special_tokens=True)
    # Text spelling the EOS token stays text, as transformers' split_special_tokens=True has it.
    spelled = f"a document that says {eos} in its text"
    splitting = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path),
                                                     split_special_tokens=True)
    assert ours.encode(spelled) == splitting.encode(spelled, add_special_tokens=False)
    assert ours.eos_id not in ours.encode(spelled)
    # Through the corpus: each document's ids, then EOS, in name order.
    for i, text in enumerate(TOKENIZER_TEXTS):
        _write(tmp_path / "data" / f"{i}.txt", text)
    streams = streams_of(tmp_path / "data", tokenizer=ours, val_fraction=0.0)
    assert streams.train_N.tolist() == [t for ids in expected for t in ids + [ours.eos_id]]


def test_hf_tokenizer_long_text_against_transformers(tmp_path):
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from moefold.data import HFTokenizer
    from moefold.data.tokenizer import PIECE_CHARS

    path = _bpe_tokenizer_json(tmp_path / "tokenizer.json", "bytelevel")
    text = "".join(f"line {i}: hello world café\n" for i in range(PIECE_CHARS // 20))
    assert len(text) > PIECE_CHARS  # encoded in pieces
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
    (ids_N,) = HFTokenizer(str(path)).encode_batch_np([text])
    assert ids_N.tolist() == reference.encode(text, add_special_tokens=False)


def test_byte_tokenizer_against_utf8():
    for text in TOKENIZER_TEXTS + ["\ud800 lone".encode("utf-8", "replace").decode()]:
        assert BYTES.encode(text) == list(text.encode("utf-8"))
        assert BYTES.encode_np(text).tolist() == list(text.encode("utf-8"))
        assert BYTES.decode(BYTES.encode(text) + [EOS]) == text


# ---------------------------------------------------------------------------------------------
# The shuffle: seeded, and the same global batches under any number of data ranks
# ---------------------------------------------------------------------------------------------


def _global_steps(num_sequences: int, dp: int, micro: int, accum: int, seed: int, steps: int):
    """Each optimizer step's sequences as the union of every data rank's rows (the trainer's
    tensor_split of the loader's global micro-batch), with each rank's rows checked disjoint."""
    import torch

    from moefold.data import PackedSequences, TrainLoader

    # seq_len 4 over an arange stream: a sequence's first token / 4 is its index.
    sequences = PackedSequences(np.arange(num_sequences * 4 + 1), 4)
    loader = TrainLoader(sequences, micro * dp, seed, eos_id=-1, step_size=micro * dp * accum)
    result = []
    for _ in range(steps):
        step = []
        for _ in range(accum):
            rows_B = loader.next_batch().input_ids_BS[:, 0] // 4
            shards = [shard.tolist() for shard in torch.tensor_split(rows_B, dp)]
            assert all(len(shard) == micro for shard in shards)
            step += [i for shard in shards for i in shard]
        assert len(set(step)) == len(step)
        result.append(sorted(step))
    return result


@pytest.mark.parametrize("seed", [0, 3, 2**40 + 1])
def test_global_batches_are_seeded_and_the_same_under_dp_1_2_4(seed):
    """A global batch of 8 sequences per step, over 37 sequences (4 whole steps an epoch, 5 left
    over), for 13 steps (three epochs): dp 1, 2, 4 with micro-batches and accumulation making 8."""
    layouts = [(1, 8, 1), (1, 2, 4), (2, 4, 1), (2, 1, 4), (4, 2, 1), (4, 1, 2)]
    runs = [_global_steps(37, dp, micro, accum, seed, 13) for dp, micro, accum in layouts]
    assert all(run == runs[0] for run in runs[1:])
    assert runs[0] == _global_steps(37, 1, 8, 1, seed, 13)  # deterministic
    assert runs[0] != _global_steps(37, 1, 8, 1, seed + 1, 13)
    import torch

    for epoch in range(3):  # naive reference: the seeded permutation, its 32 first sequences
        order = torch.randperm(37, generator=torch.Generator().manual_seed(
            (seed * 1_000_003 + epoch) % 2**64)).tolist()
        assert runs[0][4 * epoch:4 * epoch + 4] == [sorted(order[i:i + 8]) for i in range(0, 32, 8)]


# ---------------------------------------------------------------------------------------------
# Bad inputs: one line naming the file
# ---------------------------------------------------------------------------------------------


def _npy_header_only(path: Path) -> None:
    """A .npy whose header promises 100 int32 ids and holds 3."""
    np.save(path, np.arange(100, dtype=np.int32))
    path.write_bytes(path.read_bytes()[:-(97 * 4)])


def _dangling_link(path: Path) -> None:
    path.symlink_to(path.parent / "gone.txt")


BAD_FILES = {
    "empty txt": ("b.txt", lambda p: p.write_bytes(b""), "empty file"),
    "empty npy": ("b.npy", lambda p: np.save(p, np.zeros(0, np.uint16)), "no tokens"),
    "blank jsonl": ("b.jsonl", lambda p: p.write_text("\n  \n"), "no documents"),
    "object npy": ("b.npy", lambda p: np.save(p, np.array([1, "a"], dtype=object)),
                   "1-D integer array of token ids, got shape (2,) of object"),
    "structured npy": ("b.npy", lambda p: np.save(p, np.zeros(3, "u2,u2")), "1-D integer"),
    "bool npy": ("b.npy", lambda p: np.save(p, np.ones(3, bool)), "1-D integer"),
    "0-d npy": ("b.npy", lambda p: np.save(p, np.int32(3)), "1-D integer"),
    "truncated npy": ("b.npy", _npy_header_only, "not a valid .npy"),
    "odd bin": ("b.bin", lambda p: p.write_bytes(b"\x01\x00\x02"), "data.token_dtype"),
    "dangling symlink": ("b.txt", _dangling_link, "a symlink to"),
    "fifo": ("b.txt", lambda p: os.mkfifo(p), "not a regular file"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_file_in_a_directory_is_one_line_naming_it(tmp_path, case):
    name, make, expected = BAD_FILES[case]
    data = tmp_path / "data"
    data.mkdir()
    good = "a" + Path(name).suffix  # a good file of the same kind beside it
    if good.endswith(".npy"):
        np.save(data / good, np.arange(50, dtype=np.uint16))
    elif good.endswith(".bin"):
        np.arange(50, dtype=np.uint16).tofile(data / good)
    else:
        (data / good).write_text('{"text": "fine"}\n' if good.endswith(".jsonl") else "fine")
    make(data / name)
    with pytest.raises(Exception) as info:
        streams_of(data)
    message = str(info.value)
    assert info.type.__name__ == "DataError", f"{info.type.__name__}: {message}"
    assert message.startswith(f"data.path={data}: {name}: ") and expected in message, message
    assert "\n" not in message


def test_a_directory_without_data_files_is_one_line(tmp_path):
    from moefold.errors import DataError

    data = tmp_path / "data"
    _write(data / "README.md", "notes")
    (data / "sub").mkdir()
    with pytest.raises(DataError, match=r"^data\.path=.*data: no \.txt, \.jsonl, \.parquet, "
                                        r"\.npy or \.bin files found \(found 1 \.md\)$"):
        streams_of(data)


def _step_sequences(num_sequences: int, dp: int, micro: int, accum: int, steps: int):
    """Each step's sequence indices in the order the micro-batches take them (repeats allowed)."""
    from moefold.data import PackedSequences, TrainLoader

    sequences = PackedSequences(np.arange(num_sequences * 4 + 1), 4)
    loader = TrainLoader(sequences, micro * dp, 0, eos_id=-1, step_size=micro * dp * accum)
    def step() -> list[int]:
        return [i for _ in range(accum)
                for i in (loader.next_batch().input_ids_BS[:, 0] // 4).tolist()]

    return [step() for _ in range(steps)]


def test_a_step_longer_than_an_epoch_trains_the_same_sequences_under_any_split():
    """A global batch of 16 over 10 training sequences: micro-batches of 2 (dp 1, accum 8) took
    [0, 0, 1, 1, 2, 2, 3, 4, ...] in step 0 and micro-batches of 8 (dp 4, accum 2) [0, 0, 1, 1,
    2, 3, 3, ...]: each epoch ended where a micro-batch no longer fit, so the data depended on
    the layout. Such a step now reads the epochs' orders back to back, nothing dropped."""
    import torch

    runs = {layout: _step_sequences(10, *layout, steps=3) for layout in [(1, 2, 8), (4, 2, 2),
                                                                          (1, 8, 2)]}
    assert runs[(1, 2, 8)] == runs[(4, 2, 2)] == runs[(1, 8, 2)]
    orders = [torch.randperm(10, generator=torch.Generator().manual_seed(epoch)).tolist()
              for epoch in range(5)]
    stream = [i for order in orders for i in order]
    assert runs[(1, 2, 8)] == [stream[16 * s:16 * s + 16] for s in range(3)]


def test_a_step_longer_than_an_epoch_resumes_under_another_split():
    from moefold.data import PackedSequences, TrainLoader

    sequences = PackedSequences(np.arange(10 * 4 + 1), 4)
    expected = _step_sequences(10, 1, 2, 8, steps=4)
    saved = TrainLoader(sequences, 2, 0, eos_id=-1, step_size=16)
    for _ in range(8):  # one step of micro-batches of 2
        saved.next_batch()
    resumed = TrainLoader(sequences, 8, 0, eos_id=-1, step_size=16)
    resumed.load_state_dict(saved.state_dict())
    steps = [[i for _ in range(2) for i in (resumed.next_batch().input_ids_BS[:, 0] // 4).tolist()]
             for _ in range(3)]
    assert steps == expected[1:]


def test_a_tokenizer_json_saved_with_truncation_and_padding_encodes_whole_documents(tmp_path):
    """A tokenizer.json may carry "truncation" and "padding" (saved after a call that used them,
    as sentence-embedding exports are): every document was cut to max_length=5 ids and padded to
    12 with id 0, silently; transformers turns both off unless a call asks for them."""
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from moefold.data import HFTokenizer

    path = _bpe_tokenizer_json(tmp_path / "tokenizer.json", "bytelevel")
    saved = Tokenizer.from_file(str(path))
    saved.enable_truncation(max_length=5)
    saved.enable_padding(length=12, pad_id=0, pad_token="<|endoftext|>")
    saved.save(str(path))
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
    ours = HFTokenizer(str(path))
    texts = ["hello world " * 5, "hi", "x" * (1 << 19) + "\nnext line\n"]  # the last in pieces
    expected = [reference.encode(text, add_special_tokens=False) for text in texts]
    assert len(expected[0]) > 5
    assert ours.encode(texts[0]) == expected[0]
    assert [ids.tolist() for ids in ours.encode_batch_np(texts)] == expected


def test_text_the_tokenizer_cannot_encode_is_one_line_naming_the_document(tmp_path):
    """A WordLevel tokenizer.json without an unknown token meets a word it lacks: tokenizers
    raises a bare Exception ('WordLevel error: Missing [UNK] token from the vocabulary'), which
    reached the user as a traceback."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from moefold.data import HFTokenizer
    from moefold.errors import DataError

    saved = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "<|endoftext|>": 2}))
    saved.pre_tokenizer = pre_tokenizers.Whitespace()
    saved.save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataError, match=r"cannot encode the text \(WordLevel error: Missing"):
        tokenizer.encode("hello there")  # a generate prompt
    data = tmp_path / "data"
    _write(data / "a.txt", "hello world")
    _write(data / "b.txt", "hello there world")
    with pytest.raises(DataError) as info:
        streams_of(data, tokenizer=tokenizer, val_fraction=0.0)
    message = str(info.value)
    assert message.startswith(f"data.path={data}: b.txt: tokenizer {tmp_path / 'tokenizer.json'} "
                              "cannot encode the text (WordLevel error: Missing [UNK]"), message
    assert "\n" not in message


@pytest.mark.parametrize("name, encoding", [("a.txt", "utf-16"), ("a.txt", "utf-16-be"),
                                            ("a.txt", "utf-32"), ("a.jsonl", "utf-16")])
def test_utf16_text_is_refused_by_name_not_read_as_garbage(tmp_path, encoding, name):
    """Windows PowerShell 5's `>` writes UTF-16 with a byte-order mark: a .txt file in it was
    trained on as U+FFFD and NUL bytes ('\\ufffd\\ufffdh\\x00i\\x00...'), silently; a .jsonl one
    said 'line 1: not valid JSON', sending the user to the JSON. Bytes FF FE or FE FF never start
    UTF-8 text."""
    from moefold.errors import DataError

    text = '{"text": "hi there"}\n' if name.endswith(".jsonl") else "hi there"
    # utf-16 and utf-32 write a byte-order mark (little-endian here); utf-16-be is given one.
    raw = ("\ufeff" + text).encode(encoding) if encoding.endswith("-be") else text.encode(encoding)
    (tmp_path / name).write_bytes(raw)
    _write(tmp_path / "b.txt", "fine")
    with pytest.raises(DataError) as info:
        streams_of(tmp_path, val_fraction=0.0)
    message = str(info.value)
    assert message.startswith(f"data.path={tmp_path}: {name}: ") and "UTF-8" in message, message
    assert "\n" not in message


def test_a_bin_file_holding_a_numpy_header_is_refused(tmp_path):
    """np.save into an open file named x.bin writes a .npy: read raw, its header became ids
    (b'\\x93N' = 20115, ...) and, under a vocabulary that holds them, trained on silently; a
    uint32 array read as uint16 split every id in two."""
    from moefold.errors import DataError

    with open(tmp_path / "x.bin", "wb") as f:
        np.save(f, np.arange(100, dtype=np.uint16))
    with pytest.raises(DataError) as info:
        build_token_streams(DataConfig(path=str(tmp_path / "x.bin"), val_fraction=0.0), BYTES,
                            vocab_size=1 << 16)
    message = str(info.value)
    assert message.startswith(f"data.path={tmp_path / 'x.bin'}: ") and ".npy" in message, message
