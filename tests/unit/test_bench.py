"""`moefold bench`, its profile breakdown and the step limit, on the CPU."""

import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch

from memory_runs import one_thread  # noqa: F401  (autouse: one OpenMP thread for tiny ops)
from moefold.bench.limit import balanced_rows, step_limit
from moefold.bench.profile import (breakdown, by_name, classify_cpu_op, classify_kernel, device_idle_ms,
                                   exposed_communication, write_by_name)
from moefold.bench.run import RandomTokens
from moefold.cli import main
from moefold.config import load_config
from moefold.train.flops import meta_model, train_flops_per_token

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--train.micro_batch_size", "2", "--train.seq_len", "32"]  # a tiny config's step in ms


def benchmark_script(name: str):
    """benchmarks/<name>.py imported as a module (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / "benchmarks" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # dataclasses look their module up there
    spec.loader.exec_module(script)
    return script


def bench(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert main(["bench", *argv]) == 0
    return capsys.readouterr().out


def test_bench_tiny_prints_the_table(capsys):
    out = bench(capsys, "--config", "tiny", "--steps", "2", "--warmup", "1")
    for label in ("step time", "tokens/s", "TFLOP/s", "MFU", "peak memory"):
        assert any(line.startswith(label) for line in out.splitlines()), (label, out)
    assert "2 steps after 1 warm-up" in out and "no measured peak on the CPU" in out


def test_json_record_is_consistent(tmp_path, capsys):
    path = tmp_path / "r.json"
    start = time.perf_counter()
    bench(capsys, "--config", "tiny-qwen3", "--steps", "3", "--warmup", "1", "--json", str(path),
          "--limit", "--limit-repeats", "1", *SMALL)
    wall = time.perf_counter() - start
    r = json.loads(path.read_text())
    assert r["tokens"] == 3 * 2 * 32 and r["tokens_per_step"] == 64
    assert 0 < r["seconds"] < wall  # the timed steps are a part of the whole run
    assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"], rel=1e-12)
    assert r["step_ms_mean"] == pytest.approx(1e3 * r["seconds"] / 3, rel=1e-9)
    assert r["step_ms_min"] <= r["step_ms_mean"]
    cfg = load_config("tiny-qwen3", {"train.micro_batch_size": "2", "train.seq_len": "32"})
    flops = train_flops_per_token(meta_model(cfg), 32)  # the convention, counted independently
    assert r["flops_per_token"] == flops
    assert r["tflops"] == pytest.approx(flops * r["tokens_per_s"] / 1e12, rel=1e-12)
    assert r["mfu"] is None and r["peak_tflops_measured"] is None  # no peak on the CPU
    assert math.isfinite(r["loss"]) and abs(r["loss"] - math.log(257)) < 1.0  # random tokens
    assert r["limit_fraction"] == pytest.approx(r["limit"]["total_ms"] / r["step_ms_mean"])
    assert r["config"] == "tiny-qwen3" and r["overrides"]["train.seq_len"] == "32"


def test_printed_mfu_divides_by_logging_peak_tflops_as_the_record_does(tmp_path, capsys):
    """`logging.peak_tflops` is the peak training's MFU divides by: the record's mfu_datasheet and
    the printed MFU both use it (the table said "-" on the CPU, having no measured peak)."""
    path = tmp_path / "r.json"
    out = bench(capsys, "--config", "tiny", "--steps", "1", "--warmup", "0", "--json", str(path),
                "--logging.peak_tflops", "0.002", *SMALL)
    r = json.loads(path.read_text())
    assert r["mfu_datasheet"] == pytest.approx(r["tflops"] / 0.002, rel=1e-12)
    mfu = next(line for line in out.splitlines() if line.startswith("MFU"))
    assert mfu.split(None, 1)[1] == f"{100 * r['tflops'] / 0.002:.1f}% of logging.peak_tflops 0.002 TFLOP/s"


def test_printed_mfu_on_a_gpu_names_each_peak():
    """The measured peak first, the datasheet's beside it; a configured peak first instead."""
    from moefold.bench.run import _mfu

    r = {"mfu": 0.5, "peak_tflops_measured": 752.3, "mfu_datasheet": 0.38, "peak_tflops_datasheet": 989.0,
         "peak_tflops_configured": None}
    assert _mfu(r) == "50.0% of the measured 752 TFLOP/s (38.0% of the datasheet 989)"
    r.update(mfu_datasheet=0.4, peak_tflops_datasheet=940.0, peak_tflops_configured=940.0)
    assert _mfu(r) == "40.0% of logging.peak_tflops 940 TFLOP/s (50.0% of the measured 752)"
    r.update(mfu_datasheet=None, peak_tflops_datasheet=None, peak_tflops_configured=None)  # an unknown GPU
    assert _mfu(r) == "50.0% of the measured 752 TFLOP/s"


def test_profile_writes_a_trace_and_a_breakdown(tmp_path, capsys):
    path = tmp_path / "r.json"
    out = bench(capsys, "--config", "tiny-qwen3", "--steps", "1", "--warmup", "1", "--profile",
                str(tmp_path / "prof"), "--json", str(path), *SMALL)
    trace = json.loads((tmp_path / "prof" / "trace.json").read_text())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert "top cpu ops by self CPU time" in out and "outside GEMM and attention" in out
    p = json.loads(path.read_text())["profile"]
    for key in ("gemm_share", "attention_share", "outside_share"):
        assert 0.0 <= p[key] <= 1.0
    assert p["gemm_ms"] > 0 and p["attention_ms"] > 0 and p["other_ms"] > 0
    assert p["gemm_share"] + p["attention_share"] + p["outside_share"] == pytest.approx(1.0)
    assert {row["class"] for row in p["top"]} >= {"gemm", "other"}
    table = (tmp_path / "prof" / "by-name.tsv").read_text().splitlines()
    assert p["by_name"] == str(tmp_path / "prof" / "by-name.tsv") and "by-name.tsv" in out
    rows = [line.split("\t") for line in table[1:]]
    assert table[0] == "ms_per_step\tcalls_per_step\tclass\tname" and len(rows) > len(p["top"])
    assert [r[3] for r in rows[:len(p["top"])]] == [t["name"] for t in p["top"]]  # same order, more names
    for kind in ("gemm", "attention", "other"):  # the table holds every op the classes sum
        assert sum(float(r[0]) for r in rows if r[2] == kind) == pytest.approx(p[f"{kind}_ms"], rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("name, kind", [
    ("void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, cutlass::bfloat16_t>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_NNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>", "gemm"),
    ("void at::cuda::detail::grouped_mm_kernel", "gemm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "other"),
    ("Memcpy DtoD (Device -> Device)", "other"),
    ("triton_poi_fused__scaled_grouped_mm__to_copy_clamp_clone_div_expand_floor_divide_gt_3", "other"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("_fp8_grouped_gemm_rows", "gemm"),  # moefold's Triton GEMMs (fp8/triton_grouped.py)
    ("_fp8_grouped_gemm_contract", "gemm"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "comm"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "comm"),
])
def test_kernel_classes(name, kind):
    assert classify_kernel(name) == kind


def test_cpu_op_classes():
    assert classify_cpu_op("aten::mm", ["MmBackward0"]) == "gemm"
    assert classify_cpu_op("aten::_grouped_mm") == "gemm"
    assert classify_cpu_op("aten::bmm", ["aten::_scaled_dot_product_attention_math"]) == "attention"
    assert classify_cpu_op("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert classify_cpu_op("aten::mul", ["aten::linear"]) == "other"


def test_by_name_table(tmp_path):
    timed = [("b", "other", 500.0), ("a", "gemm", 3000.0), ("b", "other", 1500.0), ("c", "comm", 4000.0)]
    rows = by_name(timed, steps=2)
    assert [(r["name"], r["ms_per_step"], r["calls_per_step"]) for r in rows] == [
        ("c", 2.0, 0.5), ("a", 1.5, 0.5), ("b", 1.0, 1.0)]
    write_by_name(rows, tmp_path / "t.tsv")
    assert (tmp_path / "t.tsv").read_text().splitlines()[1:] == ["2.000000\t0.5\tcomm\tc", "1.500000\t0.5\tgemm\ta",
                                                               "1.000000\t1\tother\tb"]


def test_breakdown_arithmetic():
    timed = [("gemm_a", "gemm", 3000.0), ("gemm_a", "gemm", 1000.0), ("flash", "attention", 2000.0),
             ("add", "other", 1000.0)]
    b = breakdown(timed, step_us=5000.0, steps=2)  # 2 steps of 5 ms; per step 2 + 1 + 0.5 ms busy
    assert (b["gemm_ms"], b["attention_ms"], b["other_ms"]) == (2.0, 1.0, 0.5)
    assert b["gemm_share"] == pytest.approx(0.4) and b["outside_share"] == pytest.approx(0.4)
    assert b["top"][0] == {"name": "gemm_a", "class": "gemm", "ms_per_step": 2.0,
                           "calls_per_step": 1.0, "share": pytest.approx(0.4)}


def test_exposed_communication_is_what_no_compute_kernel_overlaps():
    kernels = [  # µs on the device's timeline, 2 steps
        ("gemm", "gemm", 0.0, 100.0), ("add", "other", 90.0, 150.0),
        ("ncclDevKernel_SendRecv", "comm", 120.0, 200.0),  # 150..200 exposed
        ("ncclDevKernel_ReduceScatter_RING", "comm", 180.0, 260.0),  # 200..260 exposed (with the a2a's)
        ("ncclDevKernel_SendRecv", "comm", 300.0, 400.0), ("flash_fwd", "attention", 320.0, 380.0),
    ]
    c = exposed_communication(kernels, steps=2)
    assert c["comm_busy_ms"] == pytest.approx((140 + 100) / 2 / 1e3)  # 120..260 and 300..400
    assert c["comm_exposed_ms"] == pytest.approx((110 + 40) / 2 / 1e3)
    assert c["all_to_all_ms"] == pytest.approx((80 + 100) / 2 / 1e3)
    assert c["all_to_all_exposed_ms"] == pytest.approx((50 + 40) / 2 / 1e3)


def test_random_tokens_are_shifted_windows():
    batch = RandomTokens(3, 16, 50, seed=0).next_batch()
    assert batch.input_ids_BS.shape == (3, 16) and int(batch.input_ids_BS.max()) < 50
    assert torch.equal(batch.input_ids_BS[:, 1:], batch.labels_BS[:, :-1])


def test_balanced_rows():
    assert balanced_rows(10, 4).tolist() == [3, 3, 2, 2]
    assert balanced_rows(10, 4, pad_multiple=8).tolist() == [8, 8, 8, 8]


@pytest.mark.parametrize("preset, window", [("tiny-qwen3", 0), ("tiny-deepseek", 0), ("tiny-mixtral", 0),
                                            ("tiny-mixtral", 6)])
def test_limit_covers_every_matrix_of_the_flop_count(preset, window):
    """The GEMM rows' FLOPs are the convention's count less the 1-D parameters (norm weights): so
    the limit times every matrix a token passes, once per use (the MTP head use included), and
    core attention counts a sliding window's band as the convention does (window 6 < seq 16)."""
    cfg = load_config(preset, {"train.micro_batch_size": "2", "train.seq_len": "16",
                               "model.sliding_window": str(window)})
    r = step_limit(cfg, torch.device("cpu"), torch.float32, repeats=1, optimizer=False, loss=False,
                   warmup=0)
    model = meta_model(cfg)
    vectors = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    flops = sum(row["flops_each"] * row["count"] for row in r["rows"] if row["in_sum"])
    assert flops + 6 * 32 * vectors == train_flops_per_token(model, 16) * 32
    assert r["no_optimizer_ms"] == pytest.approx(r["total_ms"]) and r["total_ms"] > 0


def test_limit_script_runs(tmp_path, capsys):
    script = benchmark_script("limit")
    path = tmp_path / "limit.json"
    assert script.main(["--config", "tiny-deepseek", "--micro-batch", "2", "--seq", "16",
                        "--device", "cpu", "--repeats", "1", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "limit (sum)" in out and "optimizer step" in out and "core attention" in out
    r = json.loads(path.read_text())
    parts = sum(row["ms"] for row in r["rows"] if row["in_sum"])
    assert r["total_ms"] == pytest.approx(parts)
    assert r["total_ms"] > r["no_optimizer_ms"] > 0


@pytest.mark.parametrize("argv, expected", [
    (["--config", "tinny"], "no such preset"),
    (["--config", "tiny", "--steps", "0"], "--steps 0 must be >= 1"),
    (["--config", "tiny", "--warmup", "-1"], "--warmup -1 must be >= 0"),
    (["--config", "tiny", "--limit", "--limit-repeats", "0"], "--limit-repeats 0 must be >= 1"),
    (["--config", "tiny", "--model.dimm", "8"], "did you mean --model.dim"),
    # bench has no --nproc: its ranks start under torchrun only (the hint named `moefold train --nproc N`)
    (["--config", "tiny", "--parallel.tp", "2"], "world size 1 is not divisible by tp·cp·pp = 2 (tp=2, cp=1, "
     "pp=1) (one process: launch the ranks with torchrun --nproc-per-node N -m moefold bench)\n"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, expected):
    capsys.readouterr()
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and expected in err, err


def test_bench_output_paths_under_a_file_are_refused_before_the_steps(tmp_path, capsys):
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    for option, path in (("--profile", taken / "prof"), ("--json", taken / "r.json"), ("--profile", taken)):
        capsys.readouterr()
        assert main(["bench", "--config", "tiny", "--steps", "1", option, str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{option} {path}: {taken} is a file" in err, err
    assert taken.read_text() == "mine"


def test_peers_rows_run_in_their_own_processes(tmp_path, capsys):
    path = tmp_path / "peers.json"
    assert benchmark_script("peers").main(["--device", "cpu", "--shapes", "tiny-qwen3", "--systems",
                                 "moefold,torchtitan", "--steps", "2", "--warmup", "0", "--repeats", "2",
                                 "--json", str(path)]) == 0
    assert "one process per run" in capsys.readouterr().out
    rows = json.loads(path.read_text())["shapes"][0]["rows"]
    ours = rows["moefold"]
    assert len(ours["repeat_step_ms"]) == 2 and len(ours["step_ms_each"]) == 4 and ours["tflops"] > 0
    assert ours["step_ms"] == pytest.approx(sum(ours["repeat_step_ms"]) / 2)
    assert ours["params_vs_moefold"] == 1.0  # the child built the shape the parent counts FLOPs of
    assert "skipped" in rows["torchtitan"] or rows["torchtitan"]["tflops"] > 0


def test_peers_fp8_row_is_wired_and_skipped_without_its_libraries():
    """TorchTitan's FP8 row needs torchtitan and torchao: without them a "not installed" row, not a
    crash (an unknown system would be "failed: KeyError")."""
    peers = benchmark_script("peers")
    assert "torchtitan-compile-fp8" in peers.SYSTEMS
    for name in ("torchtitan", "torchao"):
        try:
            __import__(name)
        except ImportError:
            break
    else:
        pytest.skip("torchtitan and torchao installed: the row would run")
    row = peers.run_one("tiny-qwen3", "torchtitan-compile-fp8", torch.device("cpu"), steps=1, warmup=0)
    assert "not installed" in row["skipped"], row


def test_peers_row_past_its_timeout_is_a_skipped_row(tmp_path):
    path = tmp_path / "peers.json"
    assert benchmark_script("peers").main(["--device", "cpu", "--shapes", "tiny-qwen3", "--systems", "moefold",
                                 "--timeout", "0.01", "--json", str(path)]) == 0
    row = json.loads(path.read_text())["shapes"][0]["rows"]["moefold"]
    assert "timeout" in row["skipped"]


def test_fp8_step_rows_are_the_asked_configs_against_bf16(tmp_path, capsys):
    """benchmarks/fp8_step.py: each row is bench of the shape with its precision options, and × is
    its tokens/s over the bf16 row's."""
    path = tmp_path / "fp8.json"
    script = benchmark_script("fp8_step")
    assert script.main(["--shapes", "tiny-qwen3", "--rows", "bf16,rowwise:bf16wg", "--steps", "2", "--warmup", "1",
                        "--set", "train.compile=false", "--set", "train.device=cpu", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["shapes"]["tiny-qwen3"]
    bf16, fp8 = rows["bf16"], rows["rowwise:bf16wg"]
    assert "precision.fp8" not in bf16["overrides"] and bf16["overrides"]["optim.master_dtype"] == "bf16+remainder"
    assert fp8["overrides"]["precision.fp8"] == "rowwise" and fp8["overrides"]["precision.fp8_weight_grad"] == "bf16"
    assert fp8["loss"] != bf16["loss"]  # FP8 (emulated on the CPU) changed the numerics: the option reached bench
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("rowwise:bf16wg "))
    assert float(line.split()[3]) == pytest.approx(fp8["tokens_per_s"] / bf16["tokens_per_s"], abs=1e-3)


def test_fp8_step_keeps_the_finished_rows_of_a_run_stopped_early(tmp_path, monkeypatch, capsys):
    """A run killed in its second row (a machine's time limit) has written the first row's record
    to --json and printed its step time."""
    script = benchmark_script("fp8_step")
    done = {"tokens_per_s": 100.0, "step_ms_mean": 20.0, "step_ms_min": 19.0}

    def run_row(shape, row, args, out):
        if row != "bf16":
            raise KeyboardInterrupt  # what a kill leaves of the loop
        return done

    monkeypatch.setattr(script, "run_row", run_row)
    path = tmp_path / "fp8.json"
    with pytest.raises(KeyboardInterrupt):
        script.main(["--shapes", "tiny-qwen3", "--rows", "bf16,rowwise", "--json", str(path)])
    assert json.loads(path.read_text()) == {"shapes": {"tiny-qwen3": {"bf16": done}}}
    assert "tiny-qwen3 bf16: 20.00 ms (min 19.00)" in capsys.readouterr().err


def test_fp8_step_counts_quantizers_and_inductor_kernels(tmp_path):
    tsv = tmp_path / "by-name.tsv"
    tsv.write_text("ms_per_step\tcalls_per_step\tclass\tname\n"
                   "3.0\t21\tother\t_fp8_quantize_columns_t\n"
                   "22.1\t42\tgemm\t_fp8_grouped_gemm_rows\n"
                   "1.5\t7\tother\ttriton_red_fused_abs_amax_0\n"
                   "0.5\t7\tother\ttriton_poi_fused_add_1\n"
                   "9.0\t1\tother\t_adamw_kernel\n")
    assert benchmark_script("fp8_step").kernel_sums(tsv) == {"quantizers_ms": 3.0, "inductor_ms": 2.0}


def test_fp8_step_refuses_unknown_rows_and_shapes_in_one_line(capsys):
    assert benchmark_script("fp8_step").main(["--shapes", "nope", "--rows", "bf16,rowwise:fast"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'nope'" in err and "bf16wg, cache" in err
    assert benchmark_script("fp8_step").main(["--json", "/no/such/folder/r.json"]) == 2  # before any row runs
    assert "--json /no/such/folder/r.json: its folder does not exist" in capsys.readouterr().err


def test_device_idle_is_the_wall_time_no_kernel_covers():
    kernels = [("gemm", "gemm", 0.0, 100.0), ("add", "other", 50.0, 150.0),  # busy 0..150
               ("flash", "attention", 300.0, 350.0)]  # busy 300..350; 2 steps over 500 µs of wall
    assert device_idle_ms(kernels, wall_us=500.0, steps=2) == pytest.approx((500 - 200) / 2 / 1e3)


def test_fp8_grouped_benchmark_operands_and_cpu_refusal(capsys):
    """benchmarks/fp8_grouped.py: every expert's rows padded to the blockwise FP8 multiple (128, a
    multiple of rowwise's 16), and without an FP8 GPU a one-line refusal with status 2."""
    script = benchmark_script("fp8_grouped")
    x_RK, grad_RN, w_EKN, offsets_E = script.operands(100, 8, 64, 32, torch.device("cpu"))
    rows_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
    assert (rows_E % 128 == 0).all() and int(offsets_E[-1]) == x_RK.shape[0] == grad_RN.shape[0] >= 100
    spans = _spans(offsets_E)
    per_expert = {  # the bf16 row's GEMMs, one expert at a time
        "forward": lambda: torch.cat([x_RK[a:b] @ w_EKN[e] for e, (a, b) in enumerate(spans)]),
        "grad_input": lambda: torch.cat([grad_RN[a:b] @ w_EKN[e].t() for e, (a, b) in enumerate(spans)]),
        "grad_weight": lambda: torch.stack([x_RK[a:b].t() @ grad_RN[a:b] for a, b in spans]),
    }
    for kind, call in script.bf16_calls(x_RK, grad_RN, w_EKN, offsets_E).items():
        torch.testing.assert_close(call().float(), per_expert[kind]().float(), rtol=2e-2, atol=2e-2, msg=kind)
    if not torch.cuda.is_available():
        assert script.main([]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def _spans(offsets_E):
    ends = offsets_E.tolist()
    return list(zip([0, *ends[:-1]], ends))
