"""The plan's parameter, gradient, remainder and moment rows are the busiest data rank's bytes.

FSDP2 shards a tensor's dim 0 as torch.chunk does: ceil(rows / ranks) rows on each rank, the last
ones shorter (64 rows over 3: 22, 22, 20), and pads its storage to that; ZeRO-1 (ddp) cuts the first
dim that splits evenly and, where none does, dim 0 the same way. The first data rank holds the most
of every tensor. The plan counted each part as the ranks' mean share (64 / 3 = 21.33 rows), below
what rank 0 holds wherever a dim does not divide by the ranks.

Reference: 3 gloo ranks, a training step of tiny models whose dims (64, 40, 257 rows; 8 experts) do
not divide by 3, and the bytes of rank 0's real parameters, gradients and optimizer states
(`planned_and_held_states`, as test_plan_bench_audit measures them), compared to the byte."""

from moefold.config import load_config

WORLD = 3
UNEVEN = {  # (preset, overrides): every layout's data group is the 3 ranks
    "tiny-qwen3 fsdp fp32": ("tiny-qwen3", {}),
    "tiny-qwen3 fsdp, bf16+remainder, fp8 moments": (
        "tiny-qwen3", {"optim.master_dtype": "bf16+remainder", "optim.exp_avg_dtype": "fp8",
                       "optim.exp_avg_sq_dtype": "fp8"}),
    "tiny-deepseek fsdp (MLA, shared expert, MTP), fp8 second moment": (
        "tiny-deepseek", {"optim.exp_avg_sq_dtype": "fp8"}),
    "tiny-deepseek ddp (ZeRO-1), bf16+remainder, fp8 moments": (
        "tiny-deepseek", {"parallel.data_parallel": "ddp", "optim.master_dtype": "bf16+remainder",
                          "optim.exp_avg_dtype": "fp8", "optim.exp_avg_sq_dtype": "fp8"}),
}
PARTS = ("parameters", "gradients", "master_weights", "optimizer_moments")


def _states_on_rank(rank: int, run_dir: str) -> dict:
    from test_plan_bench_audit import planned_and_held_states

    out = {}
    for i, (name, (preset, overrides)) in enumerate(UNEVEN.items()):
        cfg = load_config(preset, {**overrides, "train.micro_batch_size": "1", "train.seq_len": "16"})
        out[name] = planned_and_held_states(cfg, f"{run_dir}/{i}-{rank}", WORLD)
    return out


def test_state_rows_are_rank_0_s_real_bytes_on_uneven_shapes(tmp_path):
    """Before, the plan was the mean of the ranks: tiny-qwen3 fsdp fp32 planned 209,578.67 B of
    parameters (and of gradients) where rank 0 holds 227,352 B (its 22 of 64 rows, 3 of 8 experts,
    86 of 257 vocabulary rows) and the last 174,032 B; ZeRO-1's remainders 198,400 B where rank 0
    holds 212,672 B; so for every sharded part, fp8 moments' scales included."""
    from test_parallel_dims import results_on_ranks

    ranks = results_on_ranks(_states_on_rank, WORLD, tmp_path, str(tmp_path))
    for name in UNEVEN:
        for part in PARTS:
            planned, real = ranks[0][name][part][0], [r[name][part][1] for r in ranks]
            assert planned == real[0] == max(real), (name, part, planned, real)
        # the shapes are uneven: the last rank holds less than the first
        assert ranks[-1][name]["optimizer_moments"][1] < ranks[0][name]["optimizer_moments"][1], name
