"""Exit 1 listing the import cycles among kvrelay modules (grimp graph, Tarjan's SCCs), else 0."""

from __future__ import annotations

import sys

import grimp


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of 2+ modules, or one importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return found


def main() -> int:
    # TYPE_CHECKING imports count: a cycle hidden behind one is still a cycle (issue 24)
    imports = grimp.build_graph("kvrelay", exclude_type_checking_imports=False)
    modules = sorted(imports.modules)
    graph = {m: set(imports.find_modules_directly_imported_by(m)) & set(modules) for m in modules}
    cycles = strongly_connected(graph)
    if not cycles:
        print(f"no import cycles among {len(modules)} modules")
        return 0
    print(f"{len(cycles)} import cycle(s) among {len(modules)} modules:")
    for component in sorted(cycles):
        print(f"  {len(component)} modules: " + ", ".join(component))
    return 1


if __name__ == "__main__":
    sys.exit(main())
