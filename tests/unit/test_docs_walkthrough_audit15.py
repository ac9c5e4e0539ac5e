"""A new user's walkthrough of README.md and docs/*.md (benchmarks.md aside), audit 15: what the
pages state that the other docs tests did not check yet, checked against the code, each in the
style of tests/unit/test_docs_audit.py (cheap: no training)."""
import re
from pathlib import Path

from test_docs_audit import DOCS, ROOT, _plan


def _row(out: str, label: str) -> float:
    return float(re.search(rf"^ *{re.escape(label)} +([\d.]+)$", out, re.M).group(1))


def test_memory_md_sequence_parallel_figures_are_the_plans(capsys):
    """docs/memory.md's Qwen3-30B-A3B at tp 4, ep 8, 4 × 4096: norms and router with and without
    sequence parallelism, and the peak it says the plan gives now."""
    text = " ".join((ROOT / "docs/memory.md").read_text().split())
    m = re.search(r"Qwen3-30B-A3B at tp 4, ep 8, 4 × 4096: ([\d.]+) GiB of norms per GPU with sequence "
                  r"parallelism, ([\d.]+) without; ([\d.]+) GiB of router with it, ([\d.]+) without \(.*?"
                  r"now ([\d.]+)", text)
    layout = ["--config", "qwen3-30b-a3b", "--parallel.tp", "4", "--parallel.ep", "8",
              "--train.micro_batch_size", "4", "--train.seq_len", "4096"]
    with_sp = _plan([*layout, "--parallel.sequence_parallel", "true"], capsys)
    without = _plan([*layout, "--parallel.sequence_parallel", "false"], capsys)
    assert f"{_row(with_sp, 'norms (fp32 RMSNorm)'):.1f}" == m.group(1)
    assert f"{_row(without, 'norms (fp32 RMSNorm)'):.1f}" == m.group(2)
    assert f"{_row(with_sp, 'router'):.2f}" == m.group(3)
    assert f"{_row(without, 'router'):.2f}" == m.group(4)
    assert f"{_row(with_sp, 'peak (the largest phase)'):.1f}" == m.group(5)


def _titles(page: Path) -> list[str]:
    """A page's headings and its bold paragraph titles (`**Alignment and padding.**`), which the pages
    cite by name in quotes."""
    text = page.read_text()
    return ([h.strip() for h in re.findall(r"^#+ (.*)$", text, re.M)]
            + [t.strip(" .") for t in re.findall(r"^\*\*([^*]+)\*\*", text, re.M)])


def test_links_between_pages_resolve():
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            assert (doc.parent / path).exists(), f"{doc.name}: link to {target}"
            assert not anchor, f"{doc.name}: {target}: cite a section by its name in quotes, as the pages do"
        for name in re.findall(r"(?<![\w/.-])(?:docs/)?([a-z_0-9]+\.md)\b", doc.read_text()):
            assert (ROOT / "docs" / name).exists() or (ROOT / name).exists(), f"{doc.name} names {name}"


def test_sections_cited_by_name_exist():
    """`("Tests")`, `(benchmarks.md, "one read")`, `[performance.md](performance.md), "Host syncs")`:
    a quoted name closing a parenthesis is a section (a heading or a bold paragraph title) of the
    page named last before it in the parenthesis, or of the page itself."""
    cited = 0
    for doc in DOCS:
        text = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", " ".join(doc.read_text().split()))  # links: their text
        text = re.sub(r"`[^`]*`", "", text)  # code: torch.device("meta")
        for m in re.finditer(r"\(([^()]*?)\"([^\"]+)\"\)", text):
            pages = re.findall(r"([a-z_]+\.md)", m.group(1))
            page = ROOT / "docs" / pages[-1] if pages else doc
            date = re.findall(r"\d{4}-\d\d-\d\d", m.group(1))
            assert any(m.group(2) in title and title.startswith(tuple(date) or "") for title in _titles(page)), \
                f"{doc.name} cites \"{m.group(2)}\" {date} of {page.name}, which has no such section"
            cited += 1
    assert cited >= 8, "the extraction lost the pages' citations"


def test_benchmarks_entries_cited_by_date_exist():
    """`benchmarks.md, 2026-12-02`: benchmarks.md has an entry of that date."""
    dates = {title[:10] for title in _titles(ROOT / "docs/benchmarks.md")}
    cited = [(doc.name, date) for doc in DOCS
             for date in re.findall(r"benchmarks\.md\)?,? (\d{4}-\d\d-\d\d)", " ".join(doc.read_text().split()))]
    assert len(cited) >= 4, "the extraction lost the pages' citations"
    assert [(name, date) for name, date in cited if date not in dates] == []


def test_readme_documentation_lists_every_page():
    readme = (ROOT / "README.md").read_text()
    listed = set(re.findall(r"^- \[docs/([\w.]+)\]\(docs/\1\)", readme.split("## Documentation")[1], re.M))
    assert listed == {p.name for p in (ROOT / "docs").glob("*.md")}


def test_readme_extras_are_pyprojects():
    """`.[hf]`, `.[data]`, `.[viz]`, and '`.[test]` has all but `viz`'."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    named = set(re.findall(r"`\.\[(\w+)\]`", readme))
    assert named == set(extras), f"README names extras {sorted(named)}, pyproject has {sorted(extras)}"
    assert "`.[test]` has all but `viz`" in readme

    def names(extra: str) -> set[str]:
        return {re.split(r"[<>=\[ ]", requirement)[0] for requirement in extras[extra]}

    assert names("hf") | names("data") <= names("test") and not names("viz") & names("test")


def test_generate_help_names_every_source_of_the_context():
    """`moefold generate --help` on --max-new-tokens named max_position_embeddings and train.seq_len
    only; the context (python.md: `context_length(cfg)`) is YaRN's extended length where a model
    states no max_position_embeddings, and the refusal of a long --prompt names those options."""
    from moefold.cli import _build_parser
    from moefold.config import load_config
    from moefold.generate import context_length

    generate = next(a for a in _build_parser()._actions if a.dest == "command").choices["generate"]
    help_text = next(a.help for a in generate._actions if a.dest == "max_new_tokens")
    configs = [load_config("tiny"), load_config("tiny", {"model.max_position_embeddings": 64}),
               load_config("tiny", {"model.rope_scaling": "yarn", "model.rope_factor": 4.0,
                                    "model.rope_original_max_len": 128})]
    sources = [context_length(cfg)[1] for cfg in configs]
    assert len(set(sources)) == 3
    assert [s for s in sources if s not in help_text] == []


def _moefold_callables() -> dict[str, list]:
    """Every function and class moefold's modules define, by name (methods included)."""
    import importlib
    import inspect
    import pkgutil

    import moefold

    found: dict[str, list] = {}
    for info in pkgutil.walk_packages(moefold.__path__, "moefold."):
        if info.name == "moefold.__main__":  # runs the command line
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional extra (triton, transformers) not installed
            continue
        for name, obj in vars(module).items():
            if getattr(obj, "__module__", None) != module.__name__ or not callable(obj):
                continue
            found.setdefault(name, []).append(obj)
            if inspect.isclass(obj):
                for method, fn in vars(obj).items():
                    if inspect.isfunction(fn):
                        found.setdefault(method, []).append(fn)
    return found


def _parameters(obj) -> list[str] | None:
    import inspect

    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None  # takes any keyword
    return [name for name in params if name != "self"]


def test_calls_the_pages_cite_use_the_functions_parameters():
    """`build_head_loss(..., compiled=True)`: a keyword a page gives a moefold function is one of its
    parameters; and a signature cited by its parameters' names (`build_moe_layer(dim, moe, device_type,
    compute_dtype)`, three or more names the function has) names each as the function does."""
    callables = _moefold_callables()
    cited = 0
    for doc in DOCS:
        for name, args in re.findall(r"`(?:[\w.]*\.)?(\w+)\(([^`()]*)\)`", doc.read_text()):
            signatures = [p for p in map(_parameters, callables.get(name, [])) if p is not None]
            if not signatures:
                continue
            cited += 1
            words = [a.strip() for a in args.split(",") if a.strip()]
            keywords = [w.split("=")[0] for w in words if re.fullmatch(r"\w+=.*", w)]
            assert any(set(keywords) <= set(p) for p in signatures), f"{doc.name}: {name}({args})"
            bare = [w for w in words if re.fullmatch(r"[a-z_]\w*", w)]
            for params in signatures:
                if bare == words and len(set(bare) & set(params)) >= 3:
                    assert bare == params[:len(bare)], f"{doc.name}: {name}({args}), parameters {params}"
    assert cited >= 15, "the extraction lost the pages' calls"
