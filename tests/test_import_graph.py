"""No import circles inside vllm_dflash, counting imports inside functions too: a module that
must be imported lazily to dodge a circle hides a layering mistake."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_dflash"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The vllm_dflash modules `path` imports anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def test_no_import_circles():
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    # A package's __init__ importing its own submodules is how a package is assembled.
    graph = {name: {m for m in imports_of(path, set(paths)) if m != name
                    and not m.startswith(name + ".")}
             for name, path in paths.items()}
    cycles = []

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in stack:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, stack + [nxt], done)
        done.add(node)

    done: set[str] = set()
    for name in sorted(graph):
        if name not in done:
            visit(name, [name], done)
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)
