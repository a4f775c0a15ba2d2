"""The layering: no import circles among tf_mpi's Python modules, no upward include in cpp/core.

Every import counts, also one inside a function: a circle means none of its modules can be read,
tested or changed alone. Pure Python (the sources' syntax trees); no MPI, no TensorFlow.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_files(root=ROOT, package="tf_mpi"):
    """{dotted module name: path} for every .py file of `package`."""
    found = {}
    for folder, _, files in os.walk(os.path.join(root, package)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                found[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


def imports_of(name, path, modules):
    """The modules of `modules` that module `name` imports anywhere in its source."""
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in modules:
                    out.add(full)
                elif base in modules:
                    out.add(base)
    out.discard(name)
    return out


def circles(graph):
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_circle_finder_finds_a_circle():
    # The check below can fail: a two-module circle and a three-module one are found, a chain is not.
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(circles(graph)) == [["a", "b"], ["c", "d", "e"]]


def test_tf_mpi_has_no_import_circles():
    modules = module_files()
    assert "tf_mpi.ops" in modules and "tf_mpi.keras.optimizer" in modules, sorted(modules)
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert graph["tf_mpi.policy.reducer"] >= {"tf_mpi.ops", "tf_mpi.policy.compression"}, graph["tf_mpi.policy.reducer"]
    assert not circles(graph), circles(graph)


def test_cpp_includes_follow_the_layer_order():
    # cpp/README.md's rule (common <- transports <- execution <- negotiation <- engine), checked by
    # the script that names every include against it.
    import subprocess
    import sys
    run = subprocess.run([sys.executable, os.path.join(ROOT, "cpp", "check_layers.py")], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
