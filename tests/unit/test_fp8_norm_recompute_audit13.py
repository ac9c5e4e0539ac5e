"""memory.recompute 'norm' with FP8 linears under precision.fp8_saved_activations: the recompute
frees a pre-norm's output once its consumer (the attention, the FFN) ran; a linear that keeps an
FP8 copy of that output instead of the output itself keeps the copy past the free.

The one linear that reads the normed x itself and keeps it in FP8 (fp8/apply.py's
`_keeps_fp8_input`): MLA's wkv_a without q-LoRA under sequence parallelism, which reads the
rank's rows while wq all-gathers its own x. Everywhere else the first projections are siblings
sharing the normed x as it is, or (fp32 parameters under autocast) each keeps its own cast, which
the free leaves. Measured on 2 gloo ranks (tp 2, sequence parallel, emulated FP8 rowwise, fp32):
the recompute must free wkv_a's input, Tr·D + 4·Tr bytes a main block (1 byte an element and a
row's fp32 scale), in either order (the config's: build_model wraps, then apply_fp8; or
apply_recompute after apply_fp8 from Python), and the planner must count what the ranks keep."""

from dataclasses import replace

import pytest
import torch
from memory_runs import SMALL, VOCAB, SavedBytes, assert_identical, batches, train
from test_parallel_dims import results_on_ranks

from moefold.config import load_config
from moefold.fp8.apply import apply_fp8
from moefold.fp8.saved import SaveInput
from moefold.memory import apply_recompute
from moefold.models.transformer import build_model
from moefold.parallel.apply import parallelize
from moefold.parallel.dims import ParallelDims, ParallelLayout
from moefold.parallel.local import local_tensor, memory_holder

TP = 2
# MLA without q-LoRA, wkv_a's 32 + 16 output features aligned to rowwise's 16
MLA = {**SMALL, "model.q_lora_rank": "0", "model.qk_rope_head_dim": "16", "moe.capacity_factor": "1.5",
       "precision.fp8": "rowwise", "precision.fp8_saved_activations": "true", "parallel.tp": str(TP)}
NORM = {"memory.recompute": '["norm"]'}
WKV_A_NOT_FP8 = {"precision.fp8_exclude": '["layers.*.attn.wkv_a"]'}


def _config(overrides: dict[str, str]):
    return load_config("tiny-deepseek", {**MLA, **overrides})


def _sp_model(layout: ParallelLayout, overrides: dict[str, str], python_recompute: bool = False):
    """The FP8 model as the trainer builds it (memory options in the config: build_model wraps,
    then apply_fp8), or with apply_recompute(['norm']) after apply_fp8; then parallelized."""
    cfg = _config(overrides)
    model = build_model(cfg, VOCAB, "cpu")
    model.init_weights(seed=0)
    apply_fp8(model, cfg.precision, "cpu", sequence_parallel=True, tp=TP)
    if python_recompute:
        apply_recompute(model, ["norm"])
    parallelize(model, layout, replace(cfg.parallel, data_parallel="ddp"))
    return model.train()


def _main_mla(model) -> list:
    return [block.attn for block in model.layers]  # the MTP block is never sequence-parallel


def _with_wkv_a_saver(model, saver_of):
    for attn in _main_mla(model):
        attn.wkv_a.saver = saver_of(attn)
    return model


class _LocalSavedBytes(SavedBytes):
    """SavedBytes of a parallelized model: a DTensor by its local shard (parameters too)."""

    def __init__(self, model, monkeypatch):
        super().__init__(torch.nn.Module(), monkeypatch)  # a DTensor parameter has no storage to read
        self.params = {memory_holder(p).untyped_storage().data_ptr() for p in model.parameters()}

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        super()._keep(memory_holder(t))
        return t


def _bytes(model) -> int:
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _LocalSavedBytes(model, monkeypatch).of_forward(model, batches(1)[0])


def _relative(a, b) -> float:
    a, b = local_tensor(a), local_tensor(b)
    return float((a - b).norm() / b.norm())


def _identical(run, ref) -> str:
    try:
        assert_identical(run, ref)
    except AssertionError as e:
        return str(e)
    return ""


def _on_rank(rank: int) -> dict:
    torch.set_num_threads(1)
    layout = ParallelLayout(ParallelDims(TP, tp=TP))
    configured, later = _sp_model(layout, NORM), _sp_model(layout, {}, python_recompute=True)
    plain = _sp_model(layout, {})
    out = {"savers": {name: [[type(a.wkv_a.saver).__name__, type(a.wq.saver).__name__] for a in _main_mla(m)]
                      for name, m in (("configured", configured), ("later", later), ("plain", plain))}}
    out["bytes"] = {"configured": _bytes(configured), "later": _bytes(later), "plain": _bytes(plain),
                    # before the fix: wkv_a kept its FP8 copy (wq's saver: FP8, its own gathered x)
                    "copy_kept": _bytes(_with_wkv_a_saver(_sp_model(layout, NORM), lambda a: a.wq.saver)),
                    # wkv_a left out of FP8: an nn.Linear keeping the normed x as it is
                    "wkv_a_not_fp8": _bytes(_sp_model(layout, {**NORM, **WKV_A_NOT_FP8}))}
    recomputed = train(_sp_model(layout, NORM))
    out["python_order_trains_as_config"] = _identical(train(_sp_model(layout, {}, python_recompute=True)), recomputed)
    # the plain FP8-kept run whose wkv_a keeps the normed x as it is: what the recompute must equal
    as_is = train(_with_wkv_a_saver(_sp_model(layout, {}), lambda a: SaveInput()))
    out["trains_as_plain_with_wkv_a_as_is"] = _identical(recomputed, as_is)
    plain_run = train(_sp_model(layout, {}))
    grads, plain_grads = recomputed.grads[0], plain_run.grads[0]
    out["first_step_differs"] = {name: _relative(grads[name], plain_grads[name]) for name in grads
                                 if not torch.equal(local_tensor(grads[name]), local_tensor(plain_grads[name]))}
    out["first_losses_equal"] = torch.equal(recomputed.losses[0], plain_run.losses[0])
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return results_on_ranks(_on_rank, TP, tmp_path_factory.mktemp("norm_fp8"))


def test_the_recomputed_norm_s_rows_are_kept_as_they_are_in_either_order(ranks):
    for r in ranks:
        assert r["savers"]["configured"] == [["SaveInput", "SaveFp8Input"]] * 2
        assert r["savers"]["later"] == r["savers"]["configured"]
        assert r["savers"]["plain"] == [["SaveFp8Input", "SaveFp8Input"]] * 2


def test_the_recompute_frees_wkv_a_s_input_to_the_byte(ranks):
    """Computed from the shapes: each main block's wkv_a no longer keeps Tr·D FP8 bytes and Tr
    fp32 row scales; the same bytes as wkv_a left out of FP8 (keeping the freed normed x), and the
    same in the Python order."""
    cfg = _config(NORM)
    Tr, D = cfg.train.micro_batch_size * cfg.train.seq_len // TP, cfg.model.dim
    for r in ranks:
        b = r["bytes"]
        assert b["copy_kept"] - b["configured"] == cfg.model.n_layers * (Tr * D + Tr * 4)
        assert b["configured"] == b["wkv_a_not_fp8"]
        assert b["later"] == b["configured"]
        assert b["configured"] < b["plain"]


def test_the_python_order_trains_as_the_config_order(ranks):
    assert [r["python_order_trains_as_config"] for r in ranks] == ["", ""]


def test_training_equals_the_plain_run_whose_wkv_a_keeps_its_input_as_it_is(ranks):
    """Bit for bit against that run; against the plain FP8-kept run only wkv_a's weight gradients
    of the sequence-parallel blocks differ in the first step (its grad_weight reads the normed x,
    not its twice-rounded FP8 copy: within FP8 noise), and the first loss is the same."""
    for r in ranks:
        assert r["trains_as_plain_with_wkv_a_as_is"] == ""
        assert r["first_losses_equal"]
        differs = r["first_step_differs"]
        assert set(differs) == {f"layers.{i}.attn.wkv_a.weight" for i in range(2)}, differs
        assert all(0 < rel < 0.05 for rel in differs.values()), differs


# The planner against the rank's measurement (plan.measure, fp32 and fp32 parameters under bf16
# autocast, where each linear keeps its own cast and the FP8 copies stay), at the default sizes.
PLAN = {"model.q_lora_rank": 0, "model.qk_rope_head_dim": 16, "precision.fp8": "rowwise",
        "precision.fp8_saved_activations": True, "train.micro_batch_size": 2, "parallel.tp": TP,
        "parallel.sequence_parallel": True}
PLAN_CASES = {"norm": NORM, "norm+up_proj": {"memory.recompute": '["norm", "mla_up_proj"]'},
              "offload": {"memory.offload": '["attn_core"]', "memory.offload_min_bytes": 0}}
DTYPES = {"fp32": ("fp32", "fp32", "fp32", ""), "bf16-fp32-params": ("bf16", "fp32", "bf16", "fp32")}


def _plan_config(case: str, dtype: str):
    compute, master = DTYPES[dtype][:2]
    return load_config("tiny-deepseek", {**PLAN, **PLAN_CASES[case], "precision.compute_dtype": compute,
                                         "optim.master_dtype": master})


def _measure_on_rank(rank: int) -> dict:
    from moefold.plan.measure import measure_saved_activations

    torch.set_num_threads(1)
    layout = ParallelLayout(ParallelDims(TP, tp=TP))
    return {f"{case} {dtype}": measure_saved_activations(_plan_config(case, dtype), DTYPES[dtype][2],
                                                         param_dtype=DTYPES[dtype][3], layout=layout).by_category
            for case in PLAN_CASES for dtype in DTYPES}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    results = results_on_ranks(_measure_on_rank, TP, tmp_path_factory.mktemp("norm_fp8_plan"))
    assert results[0] == results[1]
    return results[0]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_the_planner_counts_what_the_ranks_keep(measured, case, dtype):
    from moefold.plan import predict_memory

    plan = predict_memory(_plan_config(case, dtype), TP)
    real = {k: v for k, v in measured[f"{case} {dtype}"].items() if v}
    assert {k: v for k, v in plan.activations.items() if v} == real


def test_without_sequence_parallelism_nothing_changes():
    """Siblings share the normed x as it is (wq and wkv_a), and with fp32 parameters under
    autocast each main-block linear keeps an FP8 copy of its own cast, which the recompute
    leaves: the recompute changes no saver (the MTP block's siblings share their input always)."""
    for shared, expected in ((True, "SaveInput"), (False, "SaveFp8Input")):
        cfg = _config({**NORM, "parallel.tp": "1"})
        model = build_model(cfg, VOCAB, "cpu")
        apply_fp8(model, cfg.precision, "cpu", shared_inputs=shared)
        savers = {type(getattr(block.attn, w).saver).__name__ for block in model.layers for w in ("wq", "wkv_a")}
        assert savers == {expected}
        assert {type(m.block.attn.wkv_a.saver).__name__ for m in model.mtp.layers} == {"SaveInput"}
