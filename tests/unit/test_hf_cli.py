"""`moefold convert` both ways and `moefold train --init-from-hf`, against transformers."""

import errno
import json
import os
import re
import socket

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import TINY_OVERRIDES, cli_args  # noqa: E402
from moefold.cli import main  # noqa: E402
from moefold.config import DataConfig, load_config  # noqa: E402
from moefold.data.corpus import build_token_streams  # noqa: E402
from moefold.data.loader import PackedSequences, TrainLoader  # noqa: E402
from moefold.data.tokenizer import ByteTokenizer  # noqa: E402


@pytest.fixture
def hf_dir(tmp_path):
    """A tiny random Qwen3-MoE checkpoint as transformers writes it."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    path = tmp_path / "hf"
    model.save_pretrained(path)
    return path


def hf_tensors(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, model.state_dict()


def test_convert_round_trip_keeps_every_tensor(tmp_path, hf_dir, capsys):
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(run)]) == 0
    assert main(["generate", "--run-dir", str(run), "--prompt", "ab", "--max-new-tokens", "4"]) == 0
    back = tmp_path / "back"
    assert main(["convert", "--run-dir", str(run), "--to-hf", str(back)]) == 0
    _, original = hf_tensors(hf_dir)
    _, exported = hf_tensors(back)
    assert original.keys() == exported.keys()
    for name in original:
        assert torch.equal(original[name], exported[name]), name


def test_convert_refuses_an_out_dir_a_training_holds(tmp_path, hf_dir, capsys):
    """Run directories have one writer at a time: a conversion into one a training holds wrote its
    checkpoint and config.toml among the training's."""
    from moefold.train.run_lock import RunDirLock

    run = tmp_path / "run"
    run.mkdir()
    training = RunDirLock(run)
    training.acquire()  # as a training takes it once it writes
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(run)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"moefold: error: --out {run} is in use by a training (process {os.getpid()} on {socket.gethostname()}); "
        "wait for it to end, or choose another --out"]
    assert [p.name for p in run.iterdir()] == [".lock"]
    training.release()


def test_a_training_is_refused_an_out_dir_a_conversion_is_writing(tmp_path, hf_dir, tiny_args, capsys, monkeypatch):
    """A conversion writes its checkpoint, then config.toml: a training started in between found
    the directory free, and the two wrote over each other's files."""
    import moefold.checkpoint.hf as hf

    run, trained = tmp_path / "run", []
    convert = hf.convert_to_run_checkpoint

    def a_training_starts_meanwhile(path, run_dir):
        trained.append(main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2"]))
        return convert(path, run_dir)

    monkeypatch.setattr(hf, "convert_to_run_checkpoint", a_training_starts_meanwhile)
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(run)]) == 0
    assert trained == [2]
    assert capsys.readouterr().err.splitlines() == [
        f"moefold: error: --run-dir {run} is in use by a conversion (process {os.getpid()} on "
        f"{socket.gethostname()}); wait for it to end, or choose another --run-dir"]
    assert main(["generate", "--run-dir", str(run), "--prompt", "ab", "--max-new-tokens", "2"]) == 0

def test_convert_from_hf_flushes_config_toml_to_disk_as_a_training_does(tmp_path, hf_dir, durability_events):
    """config.toml was written in place, unflushed: a power cut soon after could leave it empty
    or half written (ext4 and XFS may write the name before the data), and the converted run
    could not be resumed. It is written beside, flushed, renamed, and its directory flushed."""
    out = tmp_path.resolve() / "run"  # as /proc/self/fd names the files
    config, tmp = out / "config.toml", out / "config.toml.tmp"
    events = durability_events
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(out)]) == 0
    assert [e for e in events if set(e[1:]) <= {out, config, tmp}] == [
        ("fsync", tmp), ("replace", tmp, config), ("fsync", out)]


def test_an_io_error_writing_convert_config_toml_is_one_line_naming_it(tmp_path, hf_dir, capsys,
                                                                       failing_config_toml_write):
    """EIO writing config.toml ended `convert --from-hf` in a traceback: one line names the file
    and the OS error, status 1, and the directory the conversion created is gone."""
    out = tmp_path / "run"
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(out)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"moefold: error: writing {out / 'config.toml'}: [Errno {errno.EIO}] Input/output error"]
    assert not out.exists()


def test_export_flushes_every_file_before_its_rename_and_the_directory_after(tmp_path, hf_dir, durability_events):
    """The shards and config.json were renamed into place unflushed: a power cut soon after could
    leave a name on an empty file (ext4 and XFS may write the rename before the data). Each is
    flushed once written, before any rename, and the directory once all are renamed."""
    from moefold.checkpoint.hf import load_pretrained, save_pretrained

    out = tmp_path.resolve() / "export"  # as /proc/self/fd names the files
    model = load_pretrained(hf_dir)
    events = durability_events
    events.clear()  # what the export writes
    save_pretrained(model, out, max_shard_bytes=2**16)
    names = [p.name for p in sorted(out.iterdir()) if p.name != "config.json"] + ["config.json"]
    assert len(names) > 3  # shards and their index
    written = [("fsync", out / f".partial-{name}") for name in names]
    renamed = [("replace", out / f".partial-{name}", out / name) for name in names]
    assert events == [*written, *renamed, ("fsync", out)]


def test_convert_keeps_the_checkpoints_load_balancing_loss(tmp_path):
    """DeepSeek's `aux_loss_alpha` with `seq_aux` is the run's sequence-level aux loss (not moefold's
    generic 0.01 micro-batch loss), and `convert --to-hf` writes the keys back."""
    import tomllib

    config = transformers.DeepseekV3Config(
        vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_nextn_predict_layers=0,
        aux_loss_alpha=0.003, seq_aux=True)
    torch.manual_seed(0)
    hf, run, back = tmp_path / "hf", tmp_path / "run", tmp_path / "back"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(hf)
    assert main(["convert", "--from-hf", str(hf), "--out", str(run)]) == 0
    moe = tomllib.loads((run / "config.toml").read_text())["moe"]
    assert (moe["aux_loss_coeff"], moe["seq_aux_loss_coeff"], moe["global_aux_loss_coeff"]) == (0.0, 0.003, 0.0)
    assert main(["convert", "--run-dir", str(run), "--to-hf", str(back)]) == 0
    written = json.loads((back / "config.json").read_text())
    assert (written["aux_loss_alpha"], written["seq_aux"]) == (0.003, True)


def test_init_from_hf_starts_at_the_transformers_loss(tmp_path, hf_dir, text_corpus):
    overrides = {k: v for k, v in TINY_OVERRIDES.items() if not k.startswith(("model.", "moe."))}
    overrides.update({"data.path": str(text_corpus), "train.steps": "1", "train.warmup_steps": "0",
                      "train.seq_len": "32"})
    run = tmp_path / "run"
    assert main(["train", "--init-from-hf", str(hf_dir), "--run-dir", str(run), *cli_args(overrides)]) == 0
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])

    # The first batch, rebuilt the way the trainer builds it.
    tokenizer = ByteTokenizer()
    streams = build_token_streams(DataConfig(path=str(text_corpus)), tokenizer, vocab_size=300)
    loader = TrainLoader(PackedSequences(streams.train_N, 32), batch_size=4, seed=0, eos_id=streams.eos_id)
    batch = loader.next_batch()
    model, _ = hf_tensors(hf_dir)
    logits = model(batch.input_ids_BS).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels_BS.flatten())
    assert first["loss"] == pytest.approx(expected.item(), rel=1e-5)


def test_init_from_hf_builds_the_overridden_model_and_refuses_other_shapes(tmp_path, hf_dir, text_corpus, capsys):
    """A model.*/moe.* override reaches the model built from the checkpoint (and the run's
    config.toml describes that model); one that changes a tensor's shape is refused in one line."""
    overrides = {k: v for k, v in TINY_OVERRIDES.items() if not k.startswith(("model.", "moe."))}
    overrides.update({"data.path": str(text_corpus), "train.steps": "1", "train.warmup_steps": "0"})
    first_loss = {}
    for name, extra in (("plain", []), ("scaled", ["--moe.routed_scaling_factor", "2.5"])):
        run = tmp_path / name
        assert main(["train", "--init-from-hf", str(hf_dir), "--run-dir", str(run), *cli_args(overrides), *extra]) == 0
        first_loss[name] = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert first_loss["scaled"] != first_loss["plain"]  # before: config.json's model, the override ignored
    assert "routed_scaling_factor = 2.5" in (tmp_path / "scaled" / "config.toml").read_text()
    capsys.readouterr()
    wider = ["--run-dir", str(tmp_path / "wider"), *cli_args(overrides), "--model.dim", "64"]
    assert main(["train", "--init-from-hf", str(hf_dir), *wider]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(r"give \S+ \[\d+, 64\], its config.json \[\d+, 32\]", err), err
    assert not (tmp_path / "wider").exists()


def test_export_carries_the_runs_tokenizer_to_init_from_hf(tmp_path, text_corpus):
    """`convert --to-hf` writes the run's tokenizer.json (and the tokenizer_config.json beside it)
    into the export, so `--init-from-hf` of the export trains with the tokenizer its embeddings
    were trained for instead of falling back to the byte-level one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    texts = [p.read_text() for p in sorted(text_corpus.rglob("*.txt"))]
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    source = tmp_path / "tok" / "bpe.json"
    source.parent.mkdir()
    tokenizer.save(str(source))
    (source.parent / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}\n')

    overrides = {**TINY_OVERRIDES, "data.path": str(text_corpus), "data.tokenizer": str(source),
                 "train.steps": "2", "train.warmup_steps": "0"}
    run, export, tuned = tmp_path / "run", tmp_path / "hf", tmp_path / "tuned"
    assert main(["train", "--run-dir", str(run), *cli_args(overrides)]) == 0
    assert main(["convert", "--run-dir", str(run), "--to-hf", str(export)]) == 0
    assert (export / "tokenizer.json").read_bytes() == source.read_bytes()
    assert (export / "tokenizer_config.json").read_bytes() == (source.parent / "tokenizer_config.json").read_bytes()

    overrides = {k: v for k, v in overrides.items() if not k.startswith(("model.", "moe.", "data.tokenizer"))}
    assert main(["train", "--init-from-hf", str(export), "--run-dir", str(tuned), *cli_args(overrides)]) == 0
    assert f'tokenizer = "{export / "tokenizer.json"}"' in (tuned / "config.toml").read_text()


def test_init_from_hf_keeps_the_configs_training_settings_of_moe(tmp_path, hf_dir, text_corpus):
    """config.json says what the model is; how its MoE layers train (capacity, aux and z-loss
    coefficients) comes from the user's --config file, as every other section does."""
    config = tmp_path / "my.toml"
    config.write_text("[moe]\ncapacity_factor = 1.25\naux_loss_coeff = 0.0\nz_loss_coeff = 0.001\n"
                      "num_experts = 64\n")  # an architecture field: config.json's wins
    overrides = {k: v for k, v in TINY_OVERRIDES.items() if not k.startswith(("model.", "moe."))}
    overrides.update({"data.path": str(text_corpus), "train.steps": "1", "train.warmup_steps": "0"})
    run = tmp_path / "run"
    assert main(["train", "--init-from-hf", str(hf_dir), "--config", str(config), "--run-dir", str(run),
                 *cli_args(overrides)]) == 0
    saved = (run / "config.toml").read_text()
    for line in ("capacity_factor = 1.25", "aux_loss_coeff = 0.0", "z_loss_coeff = 0.001", "num_experts = 4"):
        assert f"\n{line}\n" in saved, line
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert "z_loss" in first and "aux_loss" not in first


def test_init_from_hf_without_a_config_keeps_config_jsons_balancing_loss(tmp_path, hf_dir, text_corpus):
    """No --config: the load-balancing loss is the one config.json states (Qwen3-MoE's
    router_aux_loss_coef, transformers' 0.001), as convert --from-hf keeps it, not moefold's
    generic 0.01; the other training settings stay moefold's defaults."""
    overrides = {k: v for k, v in TINY_OVERRIDES.items() if not k.startswith(("model.", "moe."))}
    overrides.update({"data.path": str(text_corpus), "train.steps": "1", "train.warmup_steps": "0"})
    run = tmp_path / "run"
    assert main(["train", "--init-from-hf", str(hf_dir), "--run-dir", str(run), *cli_args(overrides)]) == 0
    saved = (run / "config.toml").read_text()
    hf_coeff = json.loads((hf_dir / "config.json").read_text())["router_aux_loss_coef"]
    assert hf_coeff != load_config(None).moe.aux_loss_coeff
    assert f"\naux_loss_coeff = {hf_coeff}\n" in saved
    assert f"\ncapacity_factor = {load_config(None).moe.capacity_factor}\n" in saved


@pytest.mark.parametrize("master", ["bf16+remainder", "bf16"])
def test_export_writes_the_weights_the_optimizer_holds(tmp_path, text_corpus, master):
    """bf16+remainder: the exact fp32 masters (bf16 parameters joined with their int16
    remainders), not the bf16-rounded parameters widened; bf16 masters: bf16, not widened."""
    from moefold.checkpoint.hf import load_pretrained
    from moefold.config import load_config
    from moefold.train.trainer import Trainer

    cfg = load_config(None, {**TINY_OVERRIDES, "data.path": str(text_corpus), "train.steps": "3",
                             "optim.master_dtype": master})
    run, export = tmp_path / "run", tmp_path / "hf"
    trainer = Trainer(cfg, run, out=lambda line: None)
    trainer.fit()
    opt = trainer.optimizer
    masters = {name: opt._load_master(p, opt.state[p]) for name, p in trainer.model.named_parameters()}
    assert main(["convert", "--run-dir", str(run), "--to-hf", str(export)]) == 0
    written = json.loads((export / "config.json").read_text())["torch_dtype"]
    assert written == {"bf16+remainder": "float32", "bf16": "bfloat16"}[master]
    exported = dict(load_pretrained(export).named_parameters())
    assert exported.keys() == masters.keys()
    for name, value in masters.items():
        assert torch.equal(exported[name], value.float()), name
    if master == "bf16+remainder":  # the check above can tell masters from their bf16 rounding
        assert any(not torch.equal(v, v.bfloat16().float()) for v in masters.values())
