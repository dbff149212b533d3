"""A cycle finder shared by the import-graph test (test_layers.py) and the call-graph test
(test_call_path.py); test files import it from here, never from each other."""


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of a directed graph (node -> the nodes it points to) as a path [a, b, ..., a], or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None
