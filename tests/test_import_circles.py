"""No tessera module imports, at the top or inside a function, a module that imports it back:
what two modules both need sits one floor below them. (Imports under `if TYPE_CHECKING:` are
for annotations only and do not count.)"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "tessera"


def _imports() -> dict[str, set[str]]:
    modules = {".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): path
               for path in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}

    class Imports(ast.NodeVisitor):
        def __init__(self, name: str):
            self.name = name

        def visit_If(self, node: ast.If) -> None:
            if "TYPE_CHECKING" in ast.unparse(node.test):
                for statement in node.orelse:
                    self.visit(statement)
            else:
                self.generic_visit(node)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
                graph[self.name] |= {t for t in targets if t in modules and t != self.name}

    for name, path in modules.items():
        Imports(name).visit(ast.parse(path.read_text()))
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, circles = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        circles.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return circles


def test_the_finder_sees_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_one_that_imports_it_back():
    assert _circles(_imports()) == []
