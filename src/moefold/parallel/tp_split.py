"""Which features of each block linear tensor parallelism splits (parallel/tensor.py's plans), for
the code that must know a linear's per-rank shape before the model is parallelized: apply_fp8,
whose FP8 kernels tile the local shard, and the memory planner, which mirrors it.
tests/unit/test_tensor_parallel.py checks this table against the shards apply_tp makes."""

# Column-wise linears split their output features, row-wise ones their input features; the rest
# (MLA's down-projections wq_a and wkv_a, a shared-expert gate) stay whole on every rank.
COLUMN_WISE = frozenset({"wq", "wk", "wv", "wq_b", "wkv_b", "w1", "w3"})
ROW_WISE = frozenset({"wo", "w2"})


def tp_local_features(attr: str, in_features: int, out_features: int, tp: int) -> tuple[int, int]:
    """(in, out) features one TP rank of `tp` computes for the block linear named `attr`."""
    if attr in COLUMN_WISE:
        return in_features, out_features // tp
    if attr in ROW_WISE:
        return in_features // tp, out_features
    return in_features, out_features
