"""Import structure: every import between packages of megatron_ngrpo goes down the layer order that
docs/ARCHITECTURE.md declares; no cycle between two files of one package.

Imports are read from the source (AST), those inside functions included: a deferred import still ties
the two modules together, it only hides the cycle from the interpreter.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "megatron_ngrpo"
TOP = "megatron_ngrpo"
ARCHITECTURE = ROOT.parent / "docs" / "ARCHITECTURE.md"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Project modules imported anywhere in ``path`` (top level, functions, ``from x import module``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target.startswith(TOP) and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _package(module: str) -> str:
    """The first-level package (``megatron_ngrpo.grpo``), or the top-level module itself."""
    return ".".join(module.split(".")[:2])


def _layers(text: str) -> list[str]:
    """The declared order, lowest first: the first word of each unindented line of the first
    fenced block of docs/ARCHITECTURE.md (indented lines continue a description)."""
    block = text.split("```", 2)[1]
    return [line.split()[0] for line in block.splitlines() if line[:1].strip()]


def _upward(graph: dict[str, set[str]], layers: list[str]) -> list[str]:
    """Imports from a package to one at or after its own place in ``layers`` (other than itself)."""
    rank = {f"{TOP}.{name}": i for i, name in enumerate(layers)}
    bad = []
    for src, dsts in graph.items():
        for dst in dsts:
            a, b = _package(src), _package(dst)
            if a != b and b != TOP and rank[b] > rank[a]:
                bad.append(f"{src} -> {dst} ({b} is declared above {a})")
    return sorted(bad)


def _unexplained_lazy_imports(path: Path) -> list[int]:
    """Lines of imports inside functions that carry no ``# lazy: why`` comment: on their first
    line, on the line above, or on the import statement they directly follow (one comment covers
    a block)."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source, str(path))
    lazy = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lazy += [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
    explained_ends, bad = set(), []
    for node in sorted(set(lazy), key=lambda n: n.lineno):
        above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
        if (
            "# lazy:" in lines[node.lineno - 1]
            or above.startswith("# lazy:")
            or node.lineno - 1 in explained_ends
        ):
            explained_ends.add(node.end_lineno)
        else:
            bad.append(node.lineno)
    return bad


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def _witness(edges, comp):
    return sorted(f"{a} -> {b}" for a in comp for b in edges.get(a, ()) if b in comp)


def test_the_walker_sees_deferred_and_relative_imports(tmp_path):
    mods = {
        "megatron_ngrpo.p.a": tmp_path / "a.py",
        "megatron_ngrpo.p.b": tmp_path / "b.py",
        "megatron_ngrpo.q": tmp_path / "q.py",
    }
    mods["megatron_ngrpo.p.a"].write_text("def f():\n    from megatron_ngrpo.p import b\n")
    mods["megatron_ngrpo.p.b"].write_text("from .a import f\nimport megatron_ngrpo.q\n")
    assert _imports("megatron_ngrpo.p.a", mods["megatron_ngrpo.p.a"], mods) == {
        "megatron_ngrpo.p.b"
    }
    assert _imports("megatron_ngrpo.p.b", mods["megatron_ngrpo.p.b"], mods) == {
        "megatron_ngrpo.p.a",
        "megatron_ngrpo.q",
    }
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_the_layer_check_sees_an_upward_arrow():
    layers = ["low", "high"]
    assert _upward({f"{TOP}.high.x": {f"{TOP}.low.y"}}, layers) == []
    assert _upward({f"{TOP}.low.y": {f"{TOP}.high.x"}}, layers) == [
        f"{TOP}.low.y -> {TOP}.high.x ({TOP}.high is declared above {TOP}.low)"
    ]
    assert _layers("text\n```\nlow   one\n      more\nhigh  two\n```\n") == layers


def test_every_package_is_declared_once():
    layers = _layers(ARCHITECTURE.read_text())
    assert len(layers) == len(set(layers)), layers
    actual = {_package(m).removeprefix(f"{TOP}.") for m in _modules() if m != TOP}
    assert actual == set(layers), (
        f"missing from docs/ARCHITECTURE.md: {sorted(actual - set(layers))}; "
        f"declared but absent: {sorted(set(layers) - actual)}"
    )


def test_imports_follow_the_declared_layer_order():
    bad = _upward(_graph(), _layers(ARCHITECTURE.read_text()))
    assert not bad, "imports against docs/ARCHITECTURE.md's order:\n" + "\n".join(bad)


def test_the_lazy_import_check_wants_a_reason(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import os\n\ndef f():\n    import json\n\ndef g():\n    # lazy: heavy\n    import json\n"
        "    import sys\n\n    import re\n    import csv  # lazy: heavy\n"
    )
    assert _unexplained_lazy_imports(path) == [4, 11]


def test_imports_inside_functions_say_why():
    bad = {
        str(p.relative_to(ROOT.parent)): lines
        for p in sorted(ROOT.rglob("*.py"))
        if (lines := _unexplained_lazy_imports(p))
    }
    assert not bad, f"imports inside functions without a '# lazy: why' comment: {bad}"


def test_no_sys_path_edits():
    """tests, bench and examples import each other as packages from the repository root."""
    pattern = re.compile(r"sys\.path\.(insert|append|extend)|sys\.path\s*[+]?=")
    found = [
        f"{p.relative_to(ROOT.parent)}:{i}"
        for folder in ("megatron_ngrpo", "tests", "bench", "examples", "tools")
        for p in sorted((ROOT.parent / folder).rglob("*.py"))
        if p.resolve() != Path(__file__).resolve()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found


def test_no_cycle_between_files_of_one_package():
    graph = _graph()
    edges = {
        src: {d for d in dsts if d.rpartition(".")[0] == src.rpartition(".")[0]}
        for src, dsts in graph.items()
    }
    cycles = _cycles(edges)
    assert not cycles, [_witness(edges, c) for c in cycles]


def test_the_vllm_protocol_stands_apart():
    """The rollout client and the server's launcher speak the protocol module, not the hook or
    the in-process engine; the protocol imports no vLLM at module level (a client's node may not
    have it)."""
    graph = _graph()
    inner = {f"{TOP}.rollout.vllm.hook", f"{TOP}.rollout.vllm.engine"}
    for user in ("client", "server"):
        assert not graph[f"{TOP}.rollout.remote.{user}"] & inner, user
    tree = ast.parse((ROOT / "rollout" / "vllm" / "protocol.py").read_text())
    top = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
    top += [n.module or "" for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert not [m for m in top if m.split(".")[0] == "vllm"], top


def _engine_names() -> set[str]:
    """The values of ``rollout.config.EngineName``, read from its source."""
    tree = ast.parse((ROOT / "rollout" / "config.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineName")
    return {
        n.value.value
        for n in cls.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
    }


def _bare_names(source: str, names: set[str]) -> list[int]:
    """Lines comparing with a string literal in ``names`` (``==``, ``!=``, ``in`` a literal
    tuple, list or set)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for op in operands:
            items = op.elts if isinstance(op, (ast.Tuple, ast.List, ast.Set)) else [op]
            if any(isinstance(i, ast.Constant) and i.value in names for i in items):
                found.append(node.lineno)
                break
    return found


def test_the_engine_name_check_sees_bare_strings():
    names = {"vllm", "remote"}
    src = 'a == "vllm"\nb in ("x", "remote")\nc == Engine.vllm\nfor d in ("vllm",): pass\n'
    assert _bare_names(src, names) == [1, 2]
    assert {"megatron", "vllm", "remote"} <= _engine_names()


def test_engine_names_are_compared_as_engine_names():
    """``rollout.engine`` is an ``EngineName``: the package compares it with the enum's members,
    never with bare strings that a renamed engine would silently stop matching."""
    names = _engine_names()
    found = {
        str(p.relative_to(ROOT.parent)): lines
        for p in sorted(ROOT.rglob("*.py"))
        if (lines := _bare_names(p.read_text(), names))
    }
    assert not found, f"bare engine-name strings compared (use EngineName): {found}"


def _outside_imports(source: str, roots: tuple[str, ...]) -> list[str]:
    """Absolute imports (anywhere in ``source``) of a module under one of ``roots``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found += [n for n in names if n.split(".")[0] in roots]
    return found


def test_the_package_never_imports_the_repository_folders():
    """tests/ (harness, doubles), bench/, examples/ and tools/ are not in the wheel: the package
    never imports them, not even inside a function."""
    roots = ("tests", "bench", "examples", "tools", "scripts")
    assert _outside_imports("def f():\n    from tests.harness import tiny\n", roots) == [
        "tests.harness"
    ]
    found = {
        str(p.relative_to(ROOT.parent)): names
        for p in sorted(ROOT.rglob("*.py"))
        if (names := _outside_imports(p.read_text(), roots))
    }
    assert not found, found


# ---- sizes (issue #39 items 1 and 6) -----------------------------------------------------------

MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 600
MAX_LINES = {"training/trainer.py": 450}  # the loop stays a thin loop over its stages


def _long_functions(source: str, limit: int) -> list[str]:
    """``name:line (n lines)`` of every function or method longer than ``limit`` lines,
    decorators excluded (``end_lineno - lineno + 1``)."""
    return [
        f"{node.name}:{node.lineno} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > limit
    ]


def _long_files(root: Path, default: int, limits: dict[str, int]) -> list[str]:
    """``path (n lines > limit)`` of every file under ``root`` longer than its limit."""
    found = []
    for p in sorted(root.rglob("*.py")):
        name = p.relative_to(root).as_posix()
        lines, limit = len(p.read_text().splitlines()), limits.get(name, default)
        if lines > limit:
            found.append(f"{name} ({lines} lines > {limit})")
    return found


def test_the_size_checks_see_long_functions_and_files(tmp_path):
    body = "".join(f"        x = {i}\n" for i in range(3))
    src = f"@decorator\ndef short():\n{body}\nclass C:\n    def long(self):\n{body}{body}"
    assert _long_functions(src, 4) == ["long:8 (7 lines)"]
    (tmp_path / "a.py").write_text("x = 1\n" * 5)
    (tmp_path / "b.py").write_text("x = 1\n" * 3)
    assert _long_files(tmp_path, 4, {}) == ["a.py (5 lines > 4)"]
    assert _long_files(tmp_path, 4, {"a.py": 5, "b.py": 2}) == ["b.py (3 lines > 2)"]


def test_no_function_over_60_lines():
    """Every function of the package fits on a screen: a longer one is split into named steps."""
    found = [
        f"{p.relative_to(ROOT.parent)}:{f}"
        for p in sorted(ROOT.rglob("*.py"))
        for f in _long_functions(p.read_text(), MAX_FUNCTION_LINES)
    ]
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {', '.join(found)}"


def test_no_file_over_600_lines_and_a_thin_trainer():
    """One concept per file: no module over 600 lines, the trainer's loop at most 450."""
    found = [f"{TOP}/{f}" for f in _long_files(ROOT, MAX_FILE_LINES, MAX_LINES)]
    assert not found, f"files over their line limit: {', '.join(found)}"
