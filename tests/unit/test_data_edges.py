"""Edge cases of moefold.data against naive references: extreme seeds, resumes under another batch
size, tokenizers whose ids leave gaps, malformed records, corpora too small to validate on."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from data_reading import deny_read

from moefold.config import DataConfig
from moefold.data import (ByteTokenizer, HFTokenizer, PackedSequences, TrainLoader,
                          build_token_streams)
from moefold.errors import DataError

MAX_SEED = 2**63 - 1  # the largest train.seed the config accepts


def arange_loader(num_sequences: int, batch_size: int, seed: int) -> TrainLoader:
    # With seq_len 4 and an arange stream, a sequence's first token / 4 is its index.
    return TrainLoader(PackedSequences(np.arange(num_sequences * 4 + 1), 4), batch_size, seed,
                       eos_id=-1)


def visited(loader: TrainLoader, num_batches: int) -> list[int]:
    return [i for _ in range(num_batches) for i in (loader.next_batch().input_ids_BS[:, 0] // 4).tolist()]


@pytest.mark.parametrize("seed", [2**62, MAX_SEED, 18_446_744_073_709])
def test_every_accepted_seed_orders_the_epochs(seed):
    """Seeds whose epoch seed (seed · 1_000_003 + epoch) passes 64 bits crashed the first batch
    (torch's manual_seed: 'Overflow when unpacking long long'); it wraps to 64 bits."""
    loader = arange_loader(num_sequences=10, batch_size=5, seed=seed)
    for epoch in range(2):
        reference = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**64)
        assert visited(loader, 2) == torch.randperm(10, generator=reference).tolist()


@pytest.mark.parametrize("before, after", [(3, 2), (2, 5), (4, 1)])
def test_a_resume_under_another_batch_size_continues_the_order(before, after):
    """The position counts sequences, not batches: a run resumed with another micro-batch size (or
    number of data ranks) goes on through the same epoch orders, across the epoch boundary."""
    original = arange_loader(num_sequences=12, batch_size=before, seed=3)
    seen = visited(original, 3)
    resumed = arange_loader(num_sequences=12, batch_size=after, seed=3)
    resumed.load_state_dict(original.state_dict())
    seen += visited(resumed, (12 - len(seen)) // after)
    orders = [torch.randperm(12, generator=torch.Generator().manual_seed(3 * 1_000_003 + e))
              for e in range(2)]
    assert seen == orders[0][:len(seen)].tolist()
    assert visited(resumed, 1) == orders[1][:after].tolist()  # a partial batch is dropped


def gapped_tokenizer(path) -> str:
    """A tokenizer.json whose ids skip from 2 to 70_000 (past uint16): 5 tokens, 70_001 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "far": 70_000}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(path))
    return str(path)


def test_a_tokenizer_with_id_gaps_keeps_its_largest_id(tmp_path):
    """Its vocabulary is one past the largest id, not the number of tokens (5): the stream stored
    id 70_000 as uint16, 4464 (another token, silently, under a larger model.vocab_size)."""
    pytest.importorskip("tokenizers")
    tokenizer = HFTokenizer(gapped_tokenizer(tmp_path / "tokenizer.json"))
    assert tokenizer.vocab_size == 70_001
    (tmp_path / "d.jsonl").write_text('{"text": "hello far"}\n{"text": "far world"}\n')
    streams = build_token_streams(DataConfig(path=str(tmp_path / "d.jsonl"), val_fraction=0.0),
                                  tokenizer, vocab_size=100_000)
    eos = tokenizer.eos_id
    assert streams.train_N.tolist() == [1, 70_000, eos, 70_000, 2, eos]


@pytest.mark.parametrize("line, kind", [('["hello"]', "array"), ('"hello"', "string"),
                                        ("3", "number"), ("null", "null"), ("true", "boolean")])
def test_a_jsonl_line_that_is_no_object_says_so(tmp_path, line, kind):
    """It was 'no field 'text' (data.text_field)', pointing at the wrong fix."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError) as info:
        build_token_streams(DataConfig(path=str(path), val_fraction=0.0), ByteTokenizer())
    assert str(info.value) == (f"data.path={path}: line 2: a JSON {kind}, not an object with "
                               "field 'text' (one object per line)")


def test_a_validation_share_too_short_names_data_val_fraction(tmp_path):
    """A small corpus at the default data.val_fraction holds out fewer tokens than one sequence:
    the message named only train.seq_len and more data, not the option that turns it off."""
    path = tmp_path / "small.txt"
    path.write_text("hello world " * 100)  # 1201 tokens; 2%: the last 24 held out
    streams = build_token_streams(DataConfig(path=str(path)), ByteTokenizer())
    assert len(streams.val_N) == round(1201 * 0.02)
    with pytest.raises(DataError) as info:
        PackedSequences(streams.val_N, 32, "validation")
    assert str(info.value) == ("train.seq_len=32: the validation stream has 24 tokens, fewer than "
                               "train.seq_len + 1 = 33; lower train.seq_len, raise "
                               "data.val_fraction or set it to 0 (no validation) or add data")
    with pytest.raises(DataError, match=r"; lower train\.seq_len or add data$"):
        PackedSequences(streams.train_N[:20], 32, "training")


def string_column(pa, layout: str, texts: list[str | None]):
    if layout == "dictionary":  # as pandas writes a category column
        return pa.array(texts).dictionary_encode()
    return pa.array(texts, {"large": pa.large_string(), "view": pa.string_view()}[layout])


@pytest.mark.parametrize("layout", ["dictionary", "large", "view"])
def test_every_arrow_string_layout_reads_as_text(tmp_path, layout):
    """A dictionary-encoded or string_view text column was refused: 'is dictionary<values=string,
    indices=int32, ordered=0>, not a string'."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    if layout == "view" and not hasattr(pa, "string_view"):
        pytest.skip("pyarrow < 16 has no string_view")
    texts = ["alpha", None, "βeta", "alpha", ""]
    pq.write_table(pa.table({"text": string_column(pa, layout, texts)}), tmp_path / "d.parquet")
    streams = build_token_streams(DataConfig(path=str(tmp_path / "d.parquet"), val_fraction=0.0),
                                  ByteTokenizer())
    eos = ByteTokenizer.eos_id
    assert streams.train_N.tolist() == [*b"alpha", eos, *"βeta".encode(), eos, *b"alpha", eos]


def test_too_few_sequences_names_the_global_micro_batch():
    """The trainer passes micro_batch_size · dp; the message said 'train.micro_batch_size=4' to a
    user who had set 2 on 2 data ranks."""
    with pytest.raises(DataError) as info:
        arange_loader(num_sequences=3, batch_size=4, seed=0)  # 2 sequences a rank, 2 ranks
    assert str(info.value) == ("train.micro_batch_size · data-parallel ranks = 4 sequences exceeds "
                               "the 3 training sequences of train.seq_len=4 tokens; lower "
                               "train.micro_batch_size or train.seq_len, or add data")



def test_invalid_utf8_in_parquet_becomes_replacement_characters(tmp_path):
    """A writer that does not check UTF-8 can store bad bytes in a string column: reading them
    raised UnicodeDecodeError (a traceback); they become U+FFFD, as in .txt and .jsonl files."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    raw = [b"ok", b"bad \xff\xfe end", None, "\u00e9".encode()]
    column = pa.array(raw, pa.binary()).view(pa.string())  # as such a writer stores it
    pq.write_table(pa.table({"text": column}), tmp_path / "d.parquet")
    streams = build_token_streams(DataConfig(path=str(tmp_path / "d.parquet"), val_fraction=0.0),
                                  ByteTokenizer())
    eos = ByteTokenizer.eos_id
    texts = ["ok", "bad \ufffd\ufffd end", "\u00e9"]
    assert streams.train_N.tolist() == [t for text in texts for t in [*text.encode(), eos]]


def test_a_corrupt_parquet_page_is_a_one_line_error(tmp_path):
    """The footer reads, a data page does not: it was pyarrow's OSError with a traceback."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    texts = [f"document {i} " * 20 for i in range(2000)]
    pq.write_table(pa.table({"text": texts}), path, use_dictionary=False)
    data = bytearray(path.read_bytes())
    data[200:4000] = b"A" * 3800  # inside the first data page, well before the footer
    path.write_bytes(bytes(data))
    with pytest.raises(DataError) as info:
        build_token_streams(DataConfig(path=str(path)), ByteTokenizer())
    message = str(info.value)
    assert message.startswith(f"data.path={path}: not a valid Parquet file (") and "\n" not in message


@pytest.mark.parametrize("name, content", [
    ("a.txt", b"text"), ("a.jsonl", b'{"text": "t"}\n'),
    ("a.npy", np.arange(9)), ("a.bin", np.arange(9, dtype=np.uint16).tobytes())],
    ids=["txt", "jsonl", "npy", "bin"])
def test_an_unreadable_data_file_is_a_one_line_error(tmp_path, monkeypatch, name, content):
    """errors.py: an unreadable data path is a DataError; it was a PermissionError traceback."""
    path = tmp_path / "data" / name
    path.parent.mkdir()
    np.save(path, content) if isinstance(content, np.ndarray) else path.write_bytes(content)
    deny_read(monkeypatch, path)
    with pytest.raises(DataError) as info:
        build_token_streams(DataConfig(path=str(path.parent)), ByteTokenizer())
    assert str(info.value) == (f"data.path={path.parent}: {name}: cannot be read "
                               "(Permission denied)")


def test_an_unlistable_subdirectory_is_an_error_not_less_data(tmp_path, monkeypatch):
    """os.walk skips a directory it cannot list: its documents went missing without a word."""
    (tmp_path / "a.txt").write_text("kept")
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "b.txt").write_text("lost")
    real_scandir = os.scandir

    def guarded_scandir(path):
        if os.fspath(path) == str(tmp_path / "private"):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", guarded_scandir)
    with pytest.raises(DataError) as info:
        build_token_streams(DataConfig(path=str(tmp_path)), ByteTokenizer())
    assert str(info.value) == f"data.path={tmp_path}: private: cannot be read (Permission denied)"


def test_the_source_line_counts_files_in_english(tmp_path):
    """'data: input.txt: 1 files' and '1 token files' were printed at every start."""
    def source(path: Path) -> str:
        return build_token_streams(DataConfig(path=str(path), val_fraction=0.0),
                                   ByteTokenizer()).source

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("one")
    assert source(tmp_path / "text" / "a.txt") == f"{tmp_path / 'text' / 'a.txt'}: 1 file, 0.0 MB"
    (tmp_path / "text" / "b.txt").write_text("two")
    assert source(tmp_path / "text") == f"{tmp_path / 'text'}: 2 files, 0.0 MB"
    (tmp_path / "tokens").mkdir()
    np.save(tmp_path / "tokens" / "a.npy", np.arange(9))
    assert source(tmp_path / "tokens") == f"{tmp_path / 'tokens'}: 1 token file, 0.0M tokens"
    np.save(tmp_path / "tokens" / "b.npy", np.arange(9))
    assert source(tmp_path / "tokens") == f"{tmp_path / 'tokens'}: 2 token files, 0.0M tokens"


class CodePointTokenizer:
    """A protocol-only tokenizer (no encode_batch_np) that undercounts its vocabulary."""

    name, vocab_size, eos_id = "codepoints", 1000, 999

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_an_id_past_the_tokenizers_vocab_size_is_refused(tmp_path):
    """'\U00010000' is id 65536, stored in the uint16 stream as 0 (another token, below every
    bound the loaders check); now named at once."""
    (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n{"text": "a\U00010000"}\n')
    with pytest.raises(DataError) as info:
        build_token_streams(DataConfig(path=str(tmp_path / "d.jsonl"), val_fraction=0.0),
                            CodePointTokenizer())
    assert str(info.value) == ("tokenizer codepoints gave id 65536 (d.jsonl:2), outside its "
                               "vocabulary [0, 1000) (its vocab_size)")
    (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n')
    streams = build_token_streams(DataConfig(path=str(tmp_path / "d.jsonl"), val_fraction=0.0),
                                  CodePointTokenizer())
    assert streams.train_N.tolist() == [ord("o"), ord("k"), 999]
