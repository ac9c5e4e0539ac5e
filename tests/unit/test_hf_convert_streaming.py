"""`moefold convert --from-hf` out of core: the model is never in anonymous memory as a whole, the
run checkpoint is the one `save_weights_only(load_pretrained(...).state_dict())` writes, and the
scratch files go away whatever happens."""

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import torch.distributed.checkpoint as torch_dcp  # noqa: E402
from conftest import TINY_OVERRIDES, cli_args  # noqa: E402
from test_hf_interop import SEQ, add_mtp_layer, deepseek_v3, hf_model_of, hub_named, qwen3  # noqa: E402

import moefold.checkpoint.dcp as moefold_dcp  # noqa: E402
from moefold.checkpoint.dcp import save_weights_only  # noqa: E402
from moefold.checkpoint.hf import SCRATCH, convert_to_run_checkpoint, load_pretrained  # noqa: E402
from moefold.cli import main  # noqa: E402
from moefold.errors import CheckpointError  # noqa: E402
from moefold.generate import load_model_from_run  # noqa: E402
from moefold.train.run_lock import LOCK_FILE  # noqa: E402

CASES = {  # name -> (transformers config, save_pretrained kwargs, add an MTP layer)
    "qwen3_moe": (lambda: qwen3(vocab_size=300), {}, False),
    "qwen3_moe-tied-sharded": (lambda: qwen3(vocab_size=300, tie_word_embeddings=True),
                               {"max_shard_size": "20KB"}, False),
    "deepseek_v3-mtp": (lambda: deepseek_v3(q_lora_rank=12, num_nextn_predict_layers=1), {}, True),
}


def make_checkpoint(case: str, path: Path) -> Path:
    make_config, save_kwargs, mtp = CASES[case]
    hf_config = make_config()
    hf_model_of(hf_config, seed=3).save_pretrained(path, **save_kwargs)
    if mtp:
        add_mtp_layer(hf_config, path, seed=3)
    return path


def safetensors_of(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(safetensors_torch.load_file(file))
    return tensors


def dcp_metadata(checkpoint: Path) -> dict:
    """Key -> (shape, dtype) of every tensor, None for other values."""
    meta = torch_dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {k: (tuple(m.size), m.properties.dtype) if hasattr(m, "size") else None for k, m in meta.items()}


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    cache = {}

    def get(case):
        if case not in cache:
            cache[case] = make_checkpoint(case, tmp_path_factory.mktemp(case) / "hf")
        return cache[case]

    return get


# ---------------------------------------------------------------------------------------------
# The converted run is today's run
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_convert_round_trip_is_bit_identical(case, hf_checkpoint, tmp_path):
    hf = hf_checkpoint(case)
    run, back = tmp_path / "run", tmp_path / "back"
    assert main(["convert", "--from-hf", str(hf), "--out", str(run)]) == 0
    assert not (run / SCRATCH).exists()
    assert main(["convert", "--run-dir", str(run), "--to-hf", str(back)]) == 0
    original, exported = safetensors_of(hf), safetensors_of(back)
    assert exported.keys() == original.keys()
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name

    # The checkpoint holds what the in-memory conversion writes, and the same model comes back.
    reference = load_pretrained(hf)
    ref_checkpoint = save_weights_only(reference.state_dict(), tmp_path / "ref")
    checkpoint = run / "checkpoints" / "step_00000000"
    assert dcp_metadata(checkpoint) == dcp_metadata(ref_checkpoint)
    model, _, _ = load_model_from_run(run, "cpu")
    assert model.state_dict().keys() == reference.state_dict().keys()
    for name, t in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    ids = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))


def test_converted_run_trains_on(hf_checkpoint, tmp_path, text_corpus):
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(hf_checkpoint("qwen3_moe")), "--out", str(run)]) == 0
    overrides = {k: v for k, v in TINY_OVERRIDES.items() if not k.startswith(("model.", "moe."))}
    overrides.update({"data.path": str(text_corpus), "train.steps": "1", "train.warmup_steps": "0"})
    assert main(["train", "--resume", str(run), *cli_args(overrides)]) == 0
    assert (run / "checkpoints" / "step_00000001").is_dir()


def test_every_tensor_is_file_backed_while_saved(hf_checkpoint, tmp_path, monkeypatch):
    """What DCP is given: each tensor a mapping of its own scratch file (no anonymous copy)."""
    seen = {}

    def save(state, checkpoint_id):
        scratch = tmp_path / "run" / SCRATCH
        for name, t in state["model"].items():
            seen[name] = t.untyped_storage().filename
            assert Path(seen[name]).parent == scratch, name
            assert t.untyped_storage().nbytes() == t.nbytes, name
        return torch_dcp.save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(moefold_dcp, "dcp", types.SimpleNamespace(save=save))
    cfg, checkpoint = convert_to_run_checkpoint(hf_checkpoint("deepseek_v3-mtp"), tmp_path / "run")
    assert cfg.model.mtp_layers == 1 and checkpoint.is_dir()
    assert seen and not (tmp_path / "run" / SCRATCH).exists()


# ---------------------------------------------------------------------------------------------
# Memory: a ~300 MB checkpoint converts with a few MB of anonymous memory
# ---------------------------------------------------------------------------------------------

_MEASURE = textwrap.dedent("""
    import json, sys, threading, time
    from pathlib import Path
    import torch
    from moefold.checkpoint.dcp import save_weights_only
    from moefold.checkpoint.hf import convert_to_run_checkpoint, load_pretrained

    def anon():  # resident anonymous memory, bytes (file-backed and page-cache pages excluded)
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    def peak_growth(work):
        base, peak, done = anon(), [0], threading.Event()
        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], anon())
                time.sleep(0.0005)
        thread = threading.Thread(target=sample)
        thread.start()
        try:
            work()
        finally:
            done.set()
            thread.join()
        return max(peak[0], anon()) - base

    hf, out, tiny = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    # Warm up on a tiny checkpoint: first calls import modules and set up torch (~25 MB, once).
    convert_to_run_checkpoint(tiny, out / "warm-up-streaming")
    save_weights_only(load_pretrained(tiny).state_dict(), out / "warm-up-in-memory")
    streaming = peak_growth(lambda: convert_to_run_checkpoint(hf, out / "streaming"))
    in_memory = peak_growth(lambda: save_weights_only(load_pretrained(hf).state_dict(), out / "in_memory"))
    print(json.dumps({"streaming": streaming, "in_memory": in_memory}))
""")


def big_checkpoint(path: Path) -> int:
    """A Qwen3-MoE checkpoint of ~300 MB fp32 in 256 KB tensors (many experts); its size in bytes."""
    config = qwen3(vocab_size=1024, hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   num_experts=96, num_experts_per_tok=2)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in hub_named(
            transformers.AutoModelForCausalLM.from_config(config).state_dict(), "qwen3_moe").items()}
    tensors = {n: torch.full(shape, 0.01 * (i % 97)) for i, (n, shape) in enumerate(shapes.items())}
    path.mkdir()
    safetensors_torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    return sum(t.nbytes for t in tensors.values())


def test_conversion_does_not_hold_the_model_in_memory(hf_checkpoint, tmp_path):
    """Peak resident anonymous memory (RssAnon, sampled every 0.5 ms in a fresh process whose
    malloc returns freed blocks to the system) grows by far less than the checkpoint while the
    streaming conversion runs; the in-memory path, measured the same way, grows by about all of it
    (which shows that the measurement would see the model)."""
    size = big_checkpoint(tmp_path / "hf")
    assert size > 250e6
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path / "hf"), str(tmp_path / "out"),
                             str(hf_checkpoint("qwen3_moe"))],
                            check=False, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    growth = json.loads(result.stdout.splitlines()[-1])
    print(f"checkpoint {size / 1e6:.0f} MB; peak RssAnon growth: streaming "
          f"{growth['streaming'] / 1e6:.1f} MB, in memory {growth['in_memory'] / 1e6:.1f} MB")
    assert growth["in_memory"] > 0.8 * size
    assert growth["streaming"] < 0.1 * size  # measured: under 1 MB
    assert dcp_metadata(tmp_path / "out" / "streaming" / "checkpoints" / "step_00000000") == \
        dcp_metadata(tmp_path / "out" / "in_memory" / "checkpoints" / "step_00000000")


# ---------------------------------------------------------------------------------------------
# Failures leave nothing behind
# ---------------------------------------------------------------------------------------------


def _edited(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = safetensors_torch.load_file(src / "model.safetensors")
    edit(tensors)
    safetensors_torch.save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_tensor_leaves_no_run(hf_checkpoint, tmp_path, capsys):
    hf = _edited(hf_checkpoint("deepseek_v3-mtp"), tmp_path / "hf",
                 lambda t: t.pop("model.layers.1.mlp.gate.e_score_correction_bias"))
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(hf), "--out", str(run)]) == 2
    assert "missing: model.layers.1.mlp.gate.e_score_correction_bias" in capsys.readouterr().err
    assert not run.exists()


@pytest.mark.parametrize("out_exists", [False, True])
def test_error_while_filling_leaves_no_scratch_and_no_run(out_exists, hf_checkpoint, tmp_path, capsys):
    """The MTP copy of the embedding is checked last, once every scratch file is written. A
    directory that was there keeps the lock file the conversion held, as a training's does."""
    def edit(tensors):
        tensors["model.layers.2.embed_tokens.weight"][0, 0] += 1

    hf = _edited(hf_checkpoint("deepseek_v3-mtp"), tmp_path / "hf", edit)
    run = tmp_path / "run"
    if out_exists:
        run.mkdir()
    assert main(["convert", "--from-hf", str(hf), "--out", str(run)]) == 2
    assert "model.layers.2.embed_tokens.weight must equal" in capsys.readouterr().err
    assert ([p.name for p in run.iterdir()] == [LOCK_FILE]) if out_exists else not run.exists()


def test_error_while_saving_leaves_no_scratch_and_no_run(hf_checkpoint, tmp_path, monkeypatch):
    def save(state, checkpoint_id):
        Path(checkpoint_id).mkdir(parents=True)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(moefold_dcp, "dcp", types.SimpleNamespace(save=save))
    run = tmp_path / "run"
    failed = r"saving checkpoint .* failed \(OSError: disk full; this rank's tensors take"  # one line, no traceback
    with pytest.raises(CheckpointError, match=failed):
        convert_to_run_checkpoint(hf_checkpoint("qwen3_moe"), run)
    assert not run.exists()
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=failed):
        convert_to_run_checkpoint(hf_checkpoint("qwen3_moe"), run)
    assert [p.name for p in run.iterdir()] == ["notes.txt"]


def test_leftover_scratch_of_an_interrupted_conversion_is_replaced(hf_checkpoint, tmp_path):
    run = tmp_path / "run"
    (run / SCRATCH).mkdir(parents=True)
    (run / SCRATCH / "000000.bin").write_bytes(b"stale")
    _, checkpoint = convert_to_run_checkpoint(hf_checkpoint("qwen3_moe"), run)
    assert checkpoint.is_dir() and not (run / SCRATCH).exists()


def test_library_error_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: no such file"):
        convert_to_run_checkpoint(tmp_path, tmp_path / "run")
    assert not (tmp_path / "run").exists()
