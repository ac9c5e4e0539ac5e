"""What README.md and docs/*.md (benchmarks.md aside: a record of measurements) state about the
code, checked against it: option names, defaults and allowed values, the commands they show, the
files and metrics a run writes. A doc that drifts from the code fails here."""
import argparse
import importlib
import json
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

from moefold.cli import _build_parser, _overrides, _rank_grid_comment
from moefold.config import (
    FP8_RECIPES, MEMORY_MODULES, SECTIONS, Config, ConfigError, field_types, flatten_table, load_config)
from moefold.plan.devices import DEVICES_GB
from moefold.train.trainer import Trainer
from tests.conftest import TINY_OVERRIDES

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md"] + [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "benchmarks.md"]
DEFAULTS = Config()


def _default(key: str):
    section, name = key.split(".")
    return getattr(getattr(DEFAULTS, section), name)


def _named_options(text: str) -> set[str]:
    """Every `section.field` a page names (with or without --), leaving out module paths and
    attributes: `data.py`, `parallel.local.held_indices`, `model.on_optimizer_step()`."""
    pattern = r"(?<![\w./-])(?:--)?((?:%s)\.[a-z_0-9]+)(?![\w.(/])" % "|".join(SECTIONS)
    return {key for key in re.findall(pattern, text) if not key.endswith((".py", ".md"))}


def _shell_commands(text: str):
    """(prefix, argv after `moefold`) of each moefold command in a ```bash block, `\\` joined."""
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line, comments=True)
            if "moefold" in words:
                i = words.index("moefold")
                yield words[:i], words[i + 1:]


def _world_size(prefix: list[str], args: argparse.Namespace) -> int | None:
    """The command's ranks; None: the fewest its layout needs (`config show`, `plan memory`)."""
    if "--nproc-per-node" in prefix:
        return int(prefix[prefix.index("--nproc-per-node") + 1])
    if args.command == "train":
        return args.nproc
    return getattr(args, "world_size", None) or getattr(args, "gpus", None)


def _is_package_attribute(key: str) -> bool:
    """`memory.apply_recompute`: a name of the package moefold.memory, not an option."""
    section, name = key.split(".")
    try:
        return hasattr(importlib.import_module(f"moefold.{section}"), name)
    except ImportError:
        return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_option_a_page_names_exists(doc):
    unknown = {key for key in _named_options(doc.read_text()) - set(field_types())
               if not _is_package_attribute(key)}
    assert not unknown, f"{doc.name} names options config.py does not have: {sorted(unknown)}"


def test_the_pages_commands_parse_and_their_configs_validate():
    """Each `moefold ...` line of a bash block parses (no unknown option), its config loads (a
    preset or the defaults), and its parallel layout fits its world size (`config show
    --world-size`'s check)."""
    commands = [(doc.name, prefix, argv) for doc in DOCS for prefix, argv in _shell_commands(doc.read_text())]
    assert len(commands) >= 20, "the extraction lost the pages' commands"
    for name, prefix, argv in commands:
        if "--help" in argv:
            continue
        args, unknown = _build_parser().parse_known_args(argv)
        assert not unknown, f"{name}: moefold {shlex.join(argv)}: unknown {unknown}"
        if not hasattr(args, "config") or (args.config or "").endswith(".toml"):
            continue
        cfg = load_config(args.config, _overrides(args))
        _rank_grid_comment(cfg, _world_size(prefix, args))


def test_parallel_table_defaults_equal_config_py():
    rows = re.findall(r"^\| `(parallel\.\w+)` \|(.*)$", (ROOT / "docs/parallel.md").read_text(), re.M)
    stated = {key: re.search(r"\(default `?([\w-]+)`?\)|`(\w+)` \(default", rest) for key, rest in rows}
    stated = {key: m.group(1) or m.group(2) for key, m in stated.items() if m}
    assert {"parallel.order", "parallel.sequence_parallel", "parallel.ep_dispatcher",
            "parallel.data_parallel"} <= set(stated)
    for key, value in stated.items():
        assert value == str(_default(key)).lower(), f"docs/parallel.md: {key} default {value}"


def test_fp8_table_defaults_and_recipes_equal_config_py():
    rows = re.findall(r"^\| `(precision\.\w+)` \| ([^|]+) \|(.*)$", (ROOT / "docs/fp8.md").read_text(), re.M)
    assert len(rows) >= 8
    for key, default, _ in rows:
        assert default.strip("` ") == str(_default(key)).lower(), f"docs/fp8.md: {key} default {default}"
    recipes = dict((key, meaning) for key, _, meaning in rows)["precision.fp8"]
    assert tuple(re.findall(r"`(\w+)`", recipes)) == FP8_RECIPES


def test_optimizer_table_values_are_the_allowed_ones():
    rows = re.findall(r"^\| `(optim\.\w+)` \| ([^|]+) \|", (ROOT / "docs/optimizer.md").read_text(), re.M)
    assert len(rows) == 3
    for key, values in rows:
        for value in re.findall(r"`([\w+]+)`", values):
            load_config(None, {key: value})
        with pytest.raises(Exception, match=re.escape(key)):
            load_config(None, {key: "fp16"})


def test_readme_recompute_names_are_memory_modules():
    text = (ROOT / "README.md").read_text()
    listed = re.search(r"`memory\.recompute`: ([\w,\s]+);", text).group(1)
    assert tuple(re.split(r",\s+", listed)) == MEMORY_MODULES


def test_plan_memory_devices_and_defaults_as_memory_md_says():
    text = (ROOT / "docs/memory.md").read_text()
    m = re.search(r"`--device ([\w|]+)` \(([\d / ]+) GB, default (\w+)\)", text)
    names, sizes, default = m.group(1).split("|"), [int(s) for s in m.group(2).split(" / ")], m.group(3)
    assert dict(zip(names, sizes)) == DEVICES_GB
    args, _ = _build_parser().parse_known_args(["plan", "memory"])
    assert args.device == default and args.gpus is None
    assert args.moe_imbalance == float(re.search(r"`--moe-imbalance F` \([^)]*default (\d+)", text).group(1))


def _metrics_table_keys() -> set[str]:
    text = (ROOT / "docs/metrics.md").read_text()
    return {key for row in re.findall(r"^\| (`[^|]+) \|", text, re.M) for key in re.findall(r"`([\w<> ]+)`", row)}


def test_metrics_a_run_writes_are_the_documented_ones(tmp_path, text_corpus):
    """Every key of metrics.jsonl is in docs/metrics.md's table and the README's list, and every
    key of the table is written by a run with every loss on (but the GPU-only one)."""
    overrides = {**TINY_OVERRIDES, "data.path": str(text_corpus), "train.steps": "2", "train.warmup_steps": "1",
                 "model.mtp_layers": "1", "moe.seq_aux_loss_coeff": "0.01", "moe.global_aux_loss_coeff": "0.01",
                 "moe.z_loss_coeff": "0.001", "checkpoint.save_at_end": "false"}
    run = tmp_path / "run"
    Trainer(load_config(None, overrides), run, out=lambda line: None).fit()
    written = {key for line in (run / "metrics.jsonl").read_text().splitlines() for key in json.loads(line)}
    documented = _metrics_table_keys()
    per_layer = {f"{loss}_per_layer" for loss in ("aux_loss", "seq_aux_loss", "global_aux_loss", "z_loss")}
    documented = (documented - {"<aux loss>_per_layer"}) | per_layer
    assert written - documented == set(), "metrics.jsonl keys docs/metrics.md does not list"
    assert documented - written == {"memory_predicted_gib"}, "docs/metrics.md keys a CPU run does not write"
    readme = (ROOT / "README.md").read_text()
    readme_keys = set(re.findall(r"`(\w+)`", re.search(r"`metrics\.jsonl` \(one JSON object(.*?)\)", readme,
                                                       re.S).group(1)))
    assert readme_keys <= documented


def test_a_run_directory_holds_what_the_readme_says(tmp_path, text_corpus):
    overrides = {**TINY_OVERRIDES, "data.path": str(text_corpus), "train.steps": "2", "train.warmup_steps": "1"}
    run = tmp_path / "run"
    Trainer(load_config(None, overrides), run, out=lambda line: None).fit()
    names = {p.name for p in run.iterdir()}
    assert {"config.toml", "metrics.jsonl", "checkpoints", ".lock"} <= names
    readme = (ROOT / "README.md").read_text()
    digits = int(re.search(r"`checkpoints/step_<N>/` \(N in (\d) digits: `step_(\d+)`\)", readme).group(1))
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step_{2:0{digits}d}"]


def _plan(argv: list[str], capsys) -> str:
    from moefold.cli import main

    capsys.readouterr()
    assert main(["plan", "memory", *argv]) == 0
    return capsys.readouterr().out


def test_memory_md_plans_print_what_it_says(capsys):
    """docs/memory.md's figures for its own commands: the chunked loss's head and peak at
    Qwen3-30B-A3B, DeepSeek-V3's last pipeline rank (the heads) with and without chunks, and the
    DeepSeek-V3-on-256-GB200 section's peak and activations."""
    text = " ".join((ROOT / "docs/memory.md").read_text().split())
    m = re.search(r"head ([\d.]+) → ([\d.]+), peak ([\d.]+) → ([\d.]+) GiB", text)
    qwen = ["--config", "qwen3-30b-a3b", "--train.micro_batch_size", "4", "--train.seq_len", "4096"]
    for chunk, head, peak in ((0, m.group(1), m.group(3)), (4096, m.group(2), m.group(4))):
        out = _plan([*qwen, "--train.loss_chunk_tokens", str(chunk)], capsys)
        assert re.search(rf"output head \+ loss +{head}\n", out) and re.search(rf"^peak \D+{peak}$", out, re.M)
    m = re.search(r"the pipeline rank with the heads: ([\d.]+) GiB, ([\d.]+) with chunks of 4096", text)
    dsv3 = ["--config", "deepseek-v3", "--gpus", "256", "--parallel.pp", "8", "--parallel.vpp", "4",
            "--parallel.ep", "32"]
    for chunk, last in ((0, m.group(1)), (4096, m.group(2))):
        out = _plan([*dsv3, "--train.loss_chunk_tokens", str(chunk)], capsys)
        assert re.search(rf"peak by pipeline rank \(GiB\):.* 7:{last}$", out, re.M), out.splitlines()[-3]
    m = re.search(r"\*\*(\d+) GiB on the busiest GPU .*? activations are (\d+) GiB", text)
    out = _plan([*dsv3, "--train.micro_batch_size", "1", "--train.seq_len", "4096", "--optim.exp_avg_dtype", "bf16",
                 "--optim.exp_avg_sq_dtype", "bf16", "--device", "gb200"], capsys)
    peak = float(re.search(r"^peak \D+([\d.]+)$", out, re.M).group(1))
    activations = float(re.search(r"^activations \(saved for backward\) +([\d.]+)$", out, re.M).group(1))
    assert (round(peak), round(activations)) == (int(m.group(1)), int(m.group(2)))


def test_deepseek_v2_lite_counts_as_features_md_says():
    """The card's 15.7B total and 2.4B active, the active count without the embedding (the other
    presets' cards count it in: tests/unit/test_presets.py)."""
    from moefold.train.flops import count_params, meta_model

    text = " ".join((ROOT / "docs/features.md").read_text().split())
    m = re.search(r"DeepSeek-V2-Lite's card counts its ([\d.]+)B active without the embedding: ([\d.]+)B here, "
                  r"([\d.]+)B with it", text)
    counts = count_params(meta_model(load_config("deepseek-v2-lite")))
    assert f"{counts.active / 1e9:.2f}" == m.group(2) and f"{counts.active_with_embedding / 1e9:.2f}" == m.group(3)
    assert counts.active / 1e9 == pytest.approx(float(m.group(1)), rel=0.03)
    assert counts.total / 1e9 == pytest.approx(15.7, rel=0.01)


def _inline_settings(text: str) -> list[list[str]]:
    """Settings the prose shows in code spans, as command-line words: `--a.b V`, `a.b=V`, `a.b = "V"`."""
    text = " ".join(text.split())
    sections = "|".join(SECTIONS)
    spans = [shlex.split(s) for s in re.findall(r"`(--(?:%s)\.\w+ [^`]+)`" % sections, text)]
    for key, value in re.findall(r"`((?:%s)\.\w+) ?= ?([^`]+)`" % sections, text):
        spans.append([f"--{key}", value.strip('"') if value.startswith('"') else value])
    return spans


def test_the_settings_the_pages_show_load():
    """Each setting a page's prose or TOML blocks show is accepted, in the tiny preset or, for
    MLA's, tiny-deepseek; for FP8's (which need it), with precision.fp8 on."""
    settings = [words for doc in DOCS for words in _inline_settings(doc.read_text())]
    settings += [[f"--{key}", json.dumps(value) if not isinstance(value, str) else value]
                 for doc in DOCS for block in re.findall(r"```toml\n(.*?)```", doc.read_text(), re.S)
                 for key, value in [tuple(kv) for kv in flatten_table(tomllib.loads(block), doc.name).items()]]
    assert len(settings) >= 30
    for words in settings:
        args, unknown = _build_parser().parse_known_args(["config", "show", *words])
        assert not unknown, f"{shlex.join(words)}: unknown {unknown}"
        errors = []
        for preset, extra in (("tiny", {}), ("tiny-deepseek", {}), ("tiny", {"precision.fp8": "rowwise"})):
            try:
                load_config(preset, {**extra, **_overrides(args)})
                break
            except ConfigError as e:
                errors.append(str(e))
        else:
            pytest.fail(f"{shlex.join(words)}: {errors}")


# Names the pages cite from torch, Triton, Transformer Engine, torchao, TorchTitan and Hugging Face.
EXTERNAL_NAMES = {
    "BlockWise128x128", "CheckpointWithoutOutput", "FakeTensorMode", "Float8Linear", "MixedPrecisionPolicy",
    "BlockWise1x128", "TensorDescriptor", "ValueError", "attention_mask", "checkpoint_wrapper",
    "destroy_process_group", "div_rn", "from_local", "get_optimizer_state_dict", "get_state_dict", "index_add",
    "is_first_microbatch", "memory_allocated", "no_grad", "parallelize_module", "purge_step", "record_stream",
    "save_for_backward", "saved_tensors_hooks", "set_state_dict", "store_param_remainders", "to_local",
    "get_num_threads", "untyped_storage", "warp_specialize", "zero_grad", "moe_input_jitter_eps"}


def test_every_code_name_a_page_cites_exists():
    """A `CamelCase` or `snake_case` name in a page's code spans is defined in moefold's code (or
    its tests and benchmarks), or is one of the outside names above: no page cites a function or
    class that was renamed or never written."""
    code = "\n".join(p.read_text() for d in ("src", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py"))
    defined = (set(re.findall(r"^\s*(?:def|class)\s+(\w+)", code, re.M)) | set(re.findall(r"^\s*(\w+)\s*[:=]", code, re.M))
               | set(re.findall(r"\.(\w+)\s*=[^=]", code)) | set(re.findall(r"\"(\w+)\"", code)))
    missing = set()
    for doc in DOCS:
        for span in re.findall(r"`([A-Za-z_][\w.]*)(?:\([^`]*\))?`", doc.read_text()):
            name = span.split(".")[-1]
            if re.fullmatch(r"[A-Z][a-z]+(?:[A-Z0-9]\w*)+|[a-z]+(?:_\d*[a-z][a-z0-9]*)+", name) and name not in defined:
                missing.add(f"{doc.name}: {span}")
    assert {m for m in missing if m.split(".")[-1].split(": ")[-1] not in EXTERNAL_NAMES} == set()


def test_mfu_is_null_on_the_cpu_unless_peak_tflops_gives_the_peak(tmp_path, text_corpus):
    mfu_row = re.search(r"^\| `mfu` \|(.*)$", (ROOT / "docs/metrics.md").read_text(), re.M).group(1)
    assert "`null` on CPU or an unknown GPU unless `logging.peak_tflops` gives the peak" in mfu_row
    overrides = {**TINY_OVERRIDES, "data.path": str(text_corpus), "train.steps": "1", "train.warmup_steps": "0",
                 "checkpoint.save_at_end": "false"}
    for peak in ("0", "2"):
        run = tmp_path / peak
        Trainer(load_config(None, {**overrides, "logging.peak_tflops": peak}), run, out=lambda line: None).fit()
        record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
        assert record["mfu"] == (record["tflops"] / 2 if peak == "2" else None)


def test_reading_a_hugging_face_checkpoint_without_safetensors_is_one_line(tmp_path, monkeypatch, capsys):
    """`pip install -e .` (README) leaves out safetensors, an [hf] extra: `convert --from-hf` and
    `train --init-from-hf` then say which package, as a tokenizer.json without tokenizers does,
    instead of a ModuleNotFoundError traceback. (Export writes safetensors files by itself.)"""
    from moefold.checkpoint.hf import save_pretrained
    from moefold.cli import main
    from moefold.models.transformer import build_model

    cfg = load_config(None, {k: v for k, v in TINY_OVERRIDES.items() if k.startswith(("model.", "moe."))})
    save_pretrained(build_model(cfg, vocab_size=257), tmp_path / "hf")
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "safetensors" in err and "pip install 'moefold[hf]'" in err, err


def test_readme_lists_every_shipped_preset():
    from moefold.config import preset_names

    text = " ".join((ROOT / "README.md").read_text().split())
    bullet = re.search(r"real-shape presets \((.*?)one-GPU experiments", text).group(1)
    assert set(re.findall(r"`([\w.-]+)`", bullet)) | {"tiny"} == set(preset_names())


def test_every_option_a_fields_help_names_exists():
    """The docstrings under config.py's fields are `moefold train --help`: they name real options too."""
    from moefold.config import field_docs

    named = {key: _named_options(doc) - set(field_types()) for key, doc in field_docs().items()}
    assert {key: names for key, names in named.items() if names} == {}


@pytest.mark.parametrize("column,config", [(1, "qwen3"), (2, "deepseek"), (3, "mixtral")])
def test_recompute_offload_md_saved_bytes_table(column, config, monkeypatch):
    """docs/recompute_offload.md's 'Measured on CPU' table is what tests/memory_runs.py's SavedBytes
    counts after one forward of 2 × 64 tokens, for every name the config has."""
    from tests.memory_runs import MODULES, SavedBytes, batches, build

    text = (ROOT / "docs/recompute_offload.md").read_text()
    table = text[text.index("| recompute | qwen3-like"):]
    rows = re.findall(r"^\| `?(\w+)`? \|(.*)\|$", table.split("\n\n")[0], re.M)
    stated = {name: cells.split("|")[column - 1].strip() for name, cells in rows[1:]}
    ids = batches(1, seq_len=64)[0]
    for name in ["none", *MODULES[config]]:
        model = build(config, None if name == "none" else {"memory.recompute": f'["{name}"]'})
        with monkeypatch.context() as m:
            assert f"{SavedBytes(model, m).of_forward(model, ids):,}" == stated[name], name


def test_a_toml_file_of_your_own_overrides_config_pys_defaults_as_the_readme_says(tmp_path):
    text = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"it overrides config\.py's defaults, not `tiny`'s \(which differ in `([\w.]+)`: (\d+) in "
                  r"`tiny`, (\d+), i\.e\. `n_heads`, in config\.py\)", text)
    block = re.search(r"```toml\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    (tmp_path / "my.toml").write_text(block)
    mine, tiny = load_config(str(tmp_path / "my.toml")), load_config("tiny")
    flat = flatten_table(tomllib.loads(block), "README")
    differ = {key for key in field_types() if key not in flat and _value_of(mine, key) != _value_of(tiny, key)}
    assert differ == {m.group(1)}
    assert (_value_of(tiny, m.group(1)), _value_of(mine, m.group(1))) == (int(m.group(2)), int(m.group(3)))
    assert all(_value_of(mine, key) == _default(key) for key in field_types() if key not in flat)


def _value_of(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def test_defaults_stated_in_prose_equal_config_pys():
    """`a.b=V` (the default), `a.b = V` (the default), (`a.b`, default `V`), the defaults `a.b = V`."""
    sections = "|".join(SECTIONS)
    stated = []
    for doc in DOCS:
        text = " ".join(doc.read_text().split())
        stated += re.findall(r"`((?:%s)\.\w+) ?= ?\"?([\w+-]+)\"?` \(the default" % sections, text)
        stated += re.findall(r"`((?:%s)\.\w+)`, default `([\w+-]+)`" % sections, text)
        stated += re.findall(r"defaults `((?:%s)\.\w+) ?= ?\"?([\w+-]+)\"?`" % sections, text)
    assert len(stated) >= 4
    for key, value in stated:
        assert value == str(_default(key)).lower(), f"{key}: stated default {value}, config.py {_default(key)}"


def test_every_file_and_test_a_page_names_exists():
    """Paths (`tests/...`, `benchmarks/...`, `src/moefold/...`, or a module path under src/moefold such
    as `fp8/recipes.py`) and `file::test` names."""
    package = ROOT / "src" / "moefold"
    for doc in DOCS:
        text = doc.read_text()
        for path in re.findall(r"(?<![\w/.])((?:tests|benchmarks|src/moefold)/[\w/.-]*\w)", text):
            assert (ROOT / path).exists(), f"{doc.name}: {path}"
        for path in re.findall(r"(?<![\w/.-])([a-z_0-9]+/[a-z_0-9/]*[a-z_0-9]+\.py)", text):
            assert (package / path).exists() or (ROOT / path).exists(), f"{doc.name}: {path}"
        for path, name in re.findall(r"`(tests/\S+?\.py)::(\w+)`", text):
            assert re.search(rf"^def {name}\b", (ROOT / path).read_text(), re.M), f"{doc.name}: {path}::{name}"


# torchrun's, and pytest-xdist's in the README's test command
OTHER_TOOLS_OPTIONS = {"--nproc-per-node", "--standalone", "--dist"}


def test_every_dashed_option_a_page_names_is_a_commands_or_a_scripts():
    """`--max-new-tokens`, `--gpu-memory`, ...: an option of a moefold command, of torchrun, of
    pytest-xdist (the README's test command) or of the benchmark script the page runs it with."""
    options = set()

    def walk(parser):
        for action in parser._actions:
            options.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    walk(_build_parser())
    scripts = "\n".join(p.read_text() for p in (ROOT / "benchmarks").glob("*.py"))
    for doc in DOCS:
        for option in set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*[a-z])(?![\w.])", doc.read_text())):
            assert option in options | OTHER_TOOLS_OPTIONS or f'"{option}"' in scripts, \
                f"{doc.name}: {option}"
