"""Data: tokenizers, the corpus as train/validation token streams, packing and loaders.

    tokenizer = build_tokenizer(cfg.data.tokenizer)
    streams = build_token_streams(cfg.data, tokenizer)
    train = TrainLoader(PackedSequences(streams.train_N, S), B, seed, streams.eos_id,
                        vocab=streams.vocab)
    val = val_batches(PackedSequences(streams.val_N, S, "validation"), B, n, streams.eos_id,
                      vocab=streams.vocab)
"""

from moefold.data.corpus import TokenStreams, build_token_streams
from moefold.data.loader import (IGNORE_INDEX, Batch, PackedSequences, TrainLoader, Vocabulary,
                                 make_batch, val_batches)
from moefold.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "ByteTokenizer",
    "HFTokenizer",
    "PackedSequences",
    "TokenStreams",
    "Tokenizer",
    "TrainLoader",
    "Vocabulary",
    "build_token_streams",
    "build_tokenizer",
    "make_batch",
    "val_batches",
]
