"""Code shown in README.md and docs/ stays true: every python block runs, or says why it cannot.

Each ```python block of README.md and docs/*.md is one of three kinds:

- **a signature** (``lite.X(a, b=1, *c, **d)``: statements that only name parameters): its
  parameters, in order, with the defaults it states, are those of the code
  (``inspect.signature``);
- **marked** on its first line with ``# ... not run by the tests: <why>`` (it needs a GPU,
  several nodes, or a library the tests do not install); such a block is only parsed;
- **an example**, which runs. The examples of every page run in one process forked from the
  test zygote (tests/zygote.py: torch imported already, no command line to re-execute), so
  every multi-process block forks, as in a notebook, in a fraction of a second, and each
  launch block starts after all the earlier pages' blocks in the same process, as a
  notebook's tenth cell does after its first nine. A page's blocks run in order, in one
  namespace and one fresh folder, as a reader pastes them one after another, after the
  stand-ins docs/index.md names (``Net``, ``dataset``, ``loader``).

Every block, of every kind, must name only real public API (``lite.X`` exists).
README's first example, as pasted into a file and run with ``python``, is in test_examples.py.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import scopedlite
from conftest import REPO, _env, run_warm

PAGES = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
MARKER = re.compile(r"^#.*not run by the tests: (?P<why>\S.*?)\)?$", re.I)

# What the pages' examples may use without defining it (docs/index.md says so): your model
# class, your dataset and your DataLoader. A small classifier, 8 features into 3 classes.
STAND_INS = """
import torch

class Net(torch.nn.Sequential):
    def __init__(self):
        super().__init__(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))

dataset = torch.utils.data.TensorDataset(
    torch.randn(64, 8, generator=torch.Generator().manual_seed(0)),
    torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(1)),
)
loader = torch.utils.data.DataLoader(dataset, batch_size=8)
"""


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def why_not_run(self) -> str | None:
        first = self.code.lstrip().splitlines()[0].strip() if self.code.strip() else ""
        match = MARKER.match(first)
        return match.group("why") if match else None


def _blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in re.finditer(r"^[ \t]*```python[^\n]*\n(.*?)^[ \t]*```", text, re.S | re.M):
        line = text[: match.start()].count("\n") + 1
        found.append(Block(page.name, line, textwrap.dedent(match.group(1))))
    return found


BLOCKS = [block for page in PAGES for block in _blocks(page)]


# -- signatures ---------------------------------------------------------------------------------


def _signature_calls(tree: ast.Module) -> list[ast.Call] | None:
    """The calls of a block that only names parameters (``lite.f(a, b=1, *c, **d)``), else None."""
    calls = []
    for statement in tree.body:
        if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)):
            return None
        call = statement.value
        func = call.func
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "lite"):
            return None
        if not all(
            isinstance(a, ast.Name) or (isinstance(a, ast.Starred) and isinstance(a.value, ast.Name)) for a in call.args
        ):
            return None
        for keyword in call.keywords:
            if keyword.arg is None:
                if not isinstance(keyword.value, ast.Name):
                    return None
            else:
                try:
                    ast.literal_eval(keyword.value)
                except ValueError:
                    return None
        calls.append(call)
    return calls or None


def _compare_signature(call: ast.Call) -> list[str]:
    name = call.func.attr  # type: ignore[attr-defined]
    code = inspect.signature(getattr(scopedlite, name))
    shown: list[tuple[str, str, object]] = []  # (name, kind, default or ...)
    for arg in call.args:
        if isinstance(arg, ast.Starred):
            shown.append((arg.value.id, "*", ...))  # type: ignore[attr-defined]
        else:
            shown.append((arg.id, "", ...))  # type: ignore[attr-defined]
    for keyword in call.keywords:
        if keyword.arg is None:
            shown.append((keyword.value.id, "**", ...))  # type: ignore[attr-defined]
        else:
            shown.append((keyword.arg, "", ast.literal_eval(keyword.value)))
    kinds = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    actual = [(p.name, kinds.get(p.kind, "")) for p in code.parameters.values()]
    problems = []
    if [(n, k) for n, k, _ in shown] != actual:
        problems.append(
            f"lite.{name}: the docs show parameters {[k + n for n, k, _ in shown]}, "
            f"the code has {[k + n for n, k in actual]}"
        )
    for param_name, _, default in shown:
        param = code.parameters.get(param_name)
        if default is not ... and param is not None and param.default != default:
            problems.append(
                f"lite.{name}: the docs give {param_name}={default!r}, the code's default is {param.default!r}"
            )
    return problems


# -- running the examples -------------------------------------------------------------------------

RUNNER = r"""
import json, linecache, os, sys, time, traceback

spec = json.load(open(sys.argv[1]))
results = {}
for page in spec["pages"]:
    folder = os.path.join(spec["folder"], page["name"])
    os.makedirs(folder)
    os.chdir(folder)
    namespace = {"__name__": "__main__"}
    exec(compile(spec["stand_ins"], "<stand-ins>", "exec"), namespace)
    for block in page["blocks"]:
        filename = f"{page['name']}:{block['line']}"
        linecache.cache[filename] = (len(block["code"]), None, block["code"].splitlines(True), filename)
        print(f"@@ {filename}", flush=True)
        print(f"@@ {filename}", file=sys.stderr, flush=True)
        start = time.monotonic()
        try:
            exec(compile(block["code"], filename, "exec"), namespace)
            outcome = {"error": None}
        except BaseException as error:  # SystemExit too: a block must not end the runner
            missing = getattr(error, "name", None) if isinstance(error, ImportError) else None
            outcome = {"error": traceback.format_exc(), "missing": missing}
        sys.stdout.flush()
        outcome["seconds"] = time.monotonic() - start
        results[filename] = outcome
        with open(spec["out"], "w") as f:  # after every block: a hang still tells what ran
            json.dump(results, f)
"""


def _kind(block: Block) -> str:
    if block.why_not_run:
        return "marked"
    if _signature_calls(ast.parse(block.code)):
        return "signature"
    return "example"


@pytest.fixture(scope="session")
def examples_run(tmp_path_factory):
    """Run every example block once, in one process forked from the zygote: page after page,
    each page's blocks in order in a namespace of its own (a page's blocks build on each
    other; pages do not, but they share the process, as a notebook's cells do). What each
    printed and raised."""
    folder = tmp_path_factory.mktemp("docs-examples")
    runner = folder / "runner.py"
    runner.write_text(RUNNER)
    pages: dict[str, list[dict[str, object]]] = {}
    for block in BLOCKS:
        if _kind(block) == "example":
            pages.setdefault(block.page, []).append({"line": block.line, "code": block.code})
    # CPU only, whatever the machine: the examples name devices=2.
    env = dict(_env(), CUDA_VISIBLE_DEVICES="", NO_MKDOCS_2_WARNING="1")
    results: dict[str, dict[str, object]] = {}
    stdout: dict[str, str] = {}
    stderr: dict[str, str] = {}
    exits: dict[str, object] = {}
    tails: dict[str, str] = {}
    out = folder / "results.json"
    spec = folder / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "folder": str(folder / "pages"),
                "out": str(out),
                "stand_ins": STAND_INS,
                "pages": [{"name": name, "blocks": blocks} for name, blocks in pages.items()],
            }
        )
    )
    try:
        proc = run_warm(runner, spec, tmp_path=folder, env=env, cwd=folder, timeout=60 + 30 * len(pages))
        text_out, text_err, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as timeout:
        text_out, text_err, code = _text(timeout.stdout), _text(timeout.stderr), "timeout"
    results.update(json.loads(out.read_text()) if out.exists() else {})
    stdout.update(_sections(text_out))
    stderr.update(_sections(text_err))
    for name in pages:
        exits[name] = code
        tails[name] = (text_out + text_err)[-3000:]
    return {"results": results, "stdout": stdout, "stderr": stderr, "exit": exits, "tail": tails}


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _sections(text: str) -> dict[str, str]:
    """Output split by the runner's ``@@ page:line`` lines (workers' lines land in their block)."""
    sections: dict[str, str] = {}
    current = "<start>"
    for line in text.splitlines(keepends=True):
        if line.startswith("@@ "):
            current = line[3:].strip()
            sections.setdefault(current, "")
        else:
            sections[current] = sections.get(current, "") + line
    return sections


_OPTIONAL = {"deepspeed", "transformers", "torchmetrics", "tensorboard"}


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_python_blocks_name_only_real_api(block):
    tree = ast.parse(block.code)
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "lite"
    }
    missing = sorted(name for name in used if not hasattr(scopedlite, name))
    assert not missing, f"docs use lite.{missing}, which scopedlite does not export"


SIGNATURES = [b for b in BLOCKS if _kind(b) == "signature"]
EXAMPLES = [b for b in BLOCKS if _kind(b) == "example"]


@pytest.mark.parametrize("block", SIGNATURES, ids=[b.id for b in SIGNATURES])
def test_signature_blocks_are_the_codes(block):
    problems = [p for call in _signature_calls(ast.parse(block.code)) or [] for p in _compare_signature(call)]
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(480)  # the first one runs every page (examples_run)
@pytest.mark.deepspeed_op  # strategies.md runs ZeRO-3: its op is built before the tests (conftest.py)
@pytest.mark.parametrize("block", EXAMPLES, ids=[b.id for b in EXAMPLES])
def test_example_blocks_run(block, examples_run):
    outcome = examples_run["results"].get(block.id)
    if outcome is None:
        pytest.fail(
            f"{block.id} did not finish (runner exit {examples_run['exit'][block.page]}):\n"
            f"{examples_run['tail'][block.page]}"
        )
    error = outcome["error"]
    if error and outcome.get("missing") in _OPTIONAL and importlib.util.find_spec(outcome["missing"]) is None:
        pytest.skip(f"{outcome['missing']} is not installed")
    if error and "pip install scopedlite[deepspeed]" in error and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    assert error is None, (
        f"{block.id} raised:\n{error}\n--- its output ---\n"
        f"{examples_run['stdout'].get(block.id, '')}{examples_run['stderr'].get(block.id, '')}"
    )


def test_every_block_is_run_checked_or_says_why_not():
    kinds = [_kind(b) for b in BLOCKS]
    assert kinds.count("example") > 40 and kinds.count("signature") > 15, kinds
    for block in BLOCKS:
        if block.why_not_run is not None:
            assert len(block.why_not_run) > 10, f"{block.id}: say why it is not run"


def test_examples_print_what_their_comments_say(examples_run):
    """A few values the pages state, as the examples printed them."""
    out = examples_run["stdout"]

    def printed(page: str, needle: str) -> str:
        hits = [text for block_id, text in out.items() if block_id.startswith(page + ":") and needle in text]
        assert hits, f"no block of {page} printed {needle!r}: {[k for k in out if k.startswith(page)]}"
        return hits[0]

    assert "padded 3.833, exact 4.500" in printed("uneven-data.md", "padded ")
    assert "0 {}" in printed("checkpoints.md", "0 {}")
    assert "{'loss': tensor(1.), 'count': 2}" in printed("api.md", "'count': 2")
    assert "[[0], [1]] [0, 1, 2, 0, 1]" in printed("api.md", "'count': 2")  # gather_for_metrics: 3 + 2 rows
    assert "gathered 21 samples" in printed("uneven-data.md", "gathered ")  # each sample once inside join
    assert "['rank0.step4.pt.trace.json', 'rank1.step4.pt.trace.json']" in printed("profiling.md", "step4")
    assert "['rank0.step3.pt.trace.json']" in printed("profiling.md", "step3")  # ranks=[0]: rank 1 wrote nothing


def test_docs_site_builds_with_warnings_as_errors(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs tooling (pip install scopedlite[docs]) is not installed")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").exists()


def test_every_environment_variable_is_on_the_environment_page():
    """docs/environment.md lists every ``SCOPEDLITE_*`` name the code, the tests and CI use,
    and names no other (a variable renamed or removed must leave the page)."""
    used: set[str] = set()
    for folder in ("scopedlite", "tests", ".ci", "benchmarks", "examples"):
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and path.suffix in ("", ".py", ".sh", ".toml", ".yml"):
                used |= set(re.findall(r"SCOPEDLITE_[A-Z_]*[A-Z]", path.read_text(errors="replace")))
    listed = set(re.findall(r"SCOPEDLITE_[A-Z_]*[A-Z]", (REPO / "docs" / "environment.md").read_text()))
    assert len(used) >= 10, used
    assert used == listed, (
        f"in the code, not on the page: {sorted(used - listed)}; on the page, not in the code: {sorted(listed - used)}"
    )


# -- measured figures: each from the file benchmarks/ writes -------------------------------------

RESULTS = REPO / "benchmarks" / "results.md"
# A paragraph that names one of these takes its measured figures from benchmarks/results.md
# (docs/benchmarks.md is that file's copy, rewritten by benchmarks/run.py).
SOURCE_NAMES = ("benchmarks/results.md", "(benchmarks.md)")
# A figure: a number with a unit of time, size or ratio, or any decimal (a ratio, a spread).
# "3×512" is a shape, not a ratio.
FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?![\d.]\d)(?:\s?(ms|µs|us|s|MB|GB|x|%)(?![\w])|\s?(×)(?!\d))?")
# What only a measurement gives: a duration in ms or µs, or seconds with decimals.
TIMING = re.compile(
    r"\d(?:\s?(?:ms|µs|us)\b|\s?(?:milli|micro)seconds?\b)|\d\.\d+\s?s\b|\bfew (?:milli|micro)seconds\b"
)
# Durations the docs state that are settings of the code, not measurements: (page, text) -> where.
SETTINGS = {
    ("launching.md", "every 50 ms"): ("scopedlite/_launch/supervise.py", "0.05"),
    ("debugging.md", "(after 0.2 s,"): ("scopedlite/_strategies/lockstep.py", "now - started < 0.2"),
}


def _prose_paragraphs(page: Path) -> list[str]:
    """The page's paragraphs outside code blocks (and, on docs/benchmarks.md, outside the
    section benchmarks/run.py copies from results.md); a table belongs to the paragraph that
    introduces it."""
    text = re.sub(r"^[ \t]*```.*?^[ \t]*```[^\n]*$", "", page.read_text(), flags=re.S | re.M)
    text = re.sub(r"<!-- results:start.*?<!-- results:end -->", "", text, flags=re.S)
    paragraphs: list[str] = []
    for chunk in re.split(r"\n[ \t]*\n", text):
        if chunk.lstrip().startswith("|") and paragraphs:
            paragraphs[-1] += "\n" + chunk
        elif chunk.strip():
            paragraphs.append(chunk)
    return paragraphs


def _unit(unit: str | None) -> str:
    return {"µs": "us", None: "", "×": "x", "%": ""}.get(unit, unit or "")


def _measured(text: str) -> list[tuple[str, str]]:
    """(number, unit) of each figure: with a unit, or a decimal."""
    return [
        (m.group(1), _unit(m.group(2) or m.group(3)))
        for m in FIGURE.finditer(text)
        if m.group(2) or m.group(3) or "." in m.group(1)
    ]


def _in_results(number: str, unit: str, results: list[tuple[float, str]]) -> bool:
    """Some figure of results.md rounds to ``number`` (to its decimals), in the same unit where
    the unit is a time or a size."""
    decimals = len(number.partition(".")[2])
    return any(
        f"{value:.{decimals}f}" == number and (unit not in ("ms", "us", "s", "MB", "GB") or got == unit)
        for value, got in results
    )


def _sourced_figures() -> list[tuple[str, str, str]]:
    """(page, number, unit) of every figure in a paragraph that names benchmarks/results.md."""
    found = []
    for page in PAGES:
        for paragraph in _prose_paragraphs(page):
            if any(name in paragraph for name in SOURCE_NAMES):
                found += [(page.name, number, unit) for number, unit in _measured(paragraph)]
    return found


def test_every_figure_quoted_from_the_benchmarks_is_in_their_results_file():
    """A paragraph that names benchmarks/results.md (or links the Benchmarks page) quotes only
    figures that file has: a figure copied from an older run, or typed by hand, fails here."""
    results = [(float(n), _unit(u)) for n, u in _measured(RESULTS.read_text())]
    results += [(float(m.group(1)), "") for m in re.finditer(r"(?<![\w.])(\d+)(?![\w.]*\d)", RESULTS.read_text())]
    figures = _sourced_figures()
    assert len(figures) > 20, figures  # the join costs, crash latency, memory, check costs
    missing = [
        f"{page}: {number} {unit}".strip() for page, number, unit in figures if not _in_results(number, unit, results)
    ]
    assert not missing, f"figures the docs attribute to benchmarks/results.md that it does not have: {missing}"


def test_a_figure_from_a_measurement_names_its_source():
    """Durations in ms or µs, or seconds with decimals, come from a measurement: the paragraph
    names benchmarks/results.md, or the figure is a setting of the code (SETTINGS)."""
    for (page, text), (path, value) in SETTINGS.items():
        assert text in (REPO / "docs" / page).read_text(), f"{page} no longer says {text!r}: drop it from SETTINGS"
        assert value in (REPO / path).read_text(), f"{path} no longer has {value}"
    unsourced = []
    for page in PAGES:
        for paragraph in _prose_paragraphs(page):
            if any(name in paragraph for name in SOURCE_NAMES):
                continue
            for match in TIMING.finditer(paragraph):
                around = paragraph[max(0, match.start() - 12) : match.end() + 12]
                if not any(p == page.name and text in paragraph for p, text in SETTINGS):
                    unsourced.append(f"{page.name}: ...{around}...")
    assert not unsourced, f"measured figures without benchmarks/results.md as their source: {unsourced}"


def test_the_benchmarks_page_shows_the_results_file_as_it_is():
    """docs/benchmarks.md's Results section is benchmarks/run.py's copy of results.md: every
    line of it is a line of that file (a figure edited by hand on the page fails here)."""
    page = (REPO / "docs" / "benchmarks.md").read_text()
    section = re.search(r"<!-- results:start[^\n]*-->\n(.*?)<!-- results:end -->", page, re.S)
    assert section, "docs/benchmarks.md lost its results markers"
    lines = set(RESULTS.read_text().splitlines())
    shown = [
        line.replace("### Notes per row", "## Notes per row") for line in section.group(1).splitlines() if line.strip()
    ]
    assert len(shown) > 20
    assert not [line for line in shown if line not in lines], (
        "lines of the page that benchmarks/results.md does not have"
    )
