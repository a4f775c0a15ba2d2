"""The layering: no import circles among tf_mpi's Python modules, imports only downward between
tf_mpi's layers (tf_mpi/README.md), no upward include in cpp/core.

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


# The compiled binding: a module of the package that imports nothing of it.
EXTENSIONS = {"tf_mpi._core"}

# tf_mpi/README.md's layers. tf_mpi/ itself holds two: the runtime and the collectives, below the
# reduction policy, and the training API, above it. Every other layer is a subpackage.
RUNTIME = {f"tf_mpi.{m}" for m in ("_core", "_unused_arguments", "adasum", "basics", "codecs", "data", "functions",
                                    "membership", "ops", "process_sets", "reduce_ops", "run", "util")}
API = {"tf_mpi", "tf_mpi.elastic", "tf_mpi.gradient_tape", "tf_mpi.mpi_ops"}
SUBPACKAGES = ("policy", "compat", "tools", "keras")
# What each layer may import besides its own modules.
MAY_IMPORT = {
    "runtime": set(),
    "policy": {"runtime"},
    "api": {"runtime", "policy"},
    "compat": {"runtime", "policy"},
    "tools": {"runtime", "policy"},
    "keras": {"runtime", "policy", "api", "compat"},
}
# Public module paths whose code lives in a subpackage: each is that module under a second name.
PUBLIC_PATHS = {"tf_mpi.grouping": "tf_mpi.policy.grouping", "tf_mpi.predict": "tf_mpi.tools.predict",
                "tf_mpi.timeline_analysis": "tf_mpi.tools.timeline_analysis",
                "tf_mpi.timeline_plot": "tf_mpi.tools.timeline_plot"}


def import_graph():
    """{module: the modules of tf_mpi it imports} for every module of tf_mpi, the binding included."""
    modules = module_files()
    known = set(modules) | EXTENSIONS
    graph = {name: imports_of(name, path, known) for name, path in modules.items()}
    graph.update({name: set() for name in EXTENSIONS})
    return graph


def layer_of(name):
    """The layer of module `name` (a key of MAY_IMPORT), "public path", or None when unassigned."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[1] in SUBPACKAGES:
        return parts[1]
    if name in RUNTIME:
        return "runtime"
    if name in API:
        return "api"
    if name in PUBLIC_PATHS:
        return "public path"
    return None


def layer_violations(graph):
    """Each import of `graph` that tf_mpi/README.md's rule forbids, as a sentence."""
    out = []
    for name in sorted(graph):
        layer = layer_of(name)
        if layer is None:
            out.append(f"{name}: in no layer (add it to tf_mpi/README.md and to RUNTIME or API here)")
            continue
        if layer == "public path":
            if graph[name] != {PUBLIC_PATHS[name]}:
                out.append(f"{name}: a public path imports only its module {PUBLIC_PATHS[name]}")
            continue
        for target in sorted(graph[name]):
            target_layer = layer_of(target)
            if target_layer == "public path":
                out.append(f"{name} imports {target}: inside tf_mpi import {PUBLIC_PATHS[target]}")
            elif target_layer != layer and target_layer not in MAY_IMPORT[layer]:
                out.append(f"{name} ({layer}) imports {target} ({target_layer}): see tf_mpi/README.md")
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
    graph = import_graph()
    # The walk reaches every subpackage.
    assert {"tf_mpi.ops", "tf_mpi.policy.reducer", "tf_mpi.compat.legacy_optimizer", "tf_mpi.tools.predict",
            "tf_mpi.keras.optimizer"} <= set(graph), sorted(graph)
    assert graph["tf_mpi.policy.reducer"] >= {"tf_mpi.ops", "tf_mpi.policy.compression"}, graph["tf_mpi.policy.reducer"]
    assert not circles(graph), circles(graph)


def test_layer_check_finds_an_upward_import():
    # The check below can fail: policy/ importing keras/, a runtime module importing policy/, a
    # module inside tf_mpi importing a public path, and a module in no layer are each named.
    graph = {"tf_mpi.policy.reducer": {"tf_mpi.keras.optimizer", "tf_mpi.ops"}, "tf_mpi.ops": {"tf_mpi.policy.sparse"},
             "tf_mpi.tools.predict": {"tf_mpi.grouping"}, "tf_mpi.grouping": {"tf_mpi.policy.grouping"},
             "tf_mpi.somewhere": set(), "tf_mpi.keras.optimizer": {"tf_mpi.compat.legacy_optimizer"}}
    found = layer_violations(graph)
    assert [line.split(":")[0].split(" (")[0] for line in found] == [
        "tf_mpi.ops", "tf_mpi.policy.reducer", "tf_mpi.somewhere", "tf_mpi.tools.predict imports tf_mpi.grouping"], found


def test_tf_mpi_imports_only_downward():
    # tf_mpi/README.md: runtime <- policy/ <- training API, compat/ <- keras/; tools/ read the runtime
    # and policy/; policy/ and tools/ never import keras/, and nothing imports tools/.
    graph = import_graph()
    for layer in MAY_IMPORT:
        assert any(layer_of(name) == layer for name in graph), f"no module in layer {layer}"
    assert not layer_violations(graph), "\n".join(layer_violations(graph))
    # The launcher runs as a file on its own (tests load it by path): it imports nothing of tf_mpi.
    assert graph["tf_mpi.run"] == set(), graph["tf_mpi.run"]


def test_cpp_includes_follow_the_layer_order():
    # cpp/README.md's rule (common <- transports <- execution <- negotiation <- engine), checked by
    # the script that names every include against it.
    import subprocess
    import sys
    run = subprocess.run([sys.executable, os.path.join(ROOT, "cpp", "check_layers.py")], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
