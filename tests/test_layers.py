"""The house's layers, read from the code's imports (every import statement, function-level and
TYPE_CHECKING ones included): core -> protocol -> serving -> app, bench on top; inside the core,
kernels -> layers -> models -> engine; inside serving, the actors and the router below the client,
service and HTTP front door. A module may import only its own layer or lower ones, and no modules
import each other in a loop."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("flame_llm", "actors", "router", "bench")

# (layer, rank) by module prefix; the longest prefix that matches decides
LAYERS = [
    ("flame_llm", ("core: engine", 4)),  # the package face: LLM, AsyncEngine, Config, ... by lazy import
    ("flame_llm.config", ("core: base", 0)),
    ("flame_llm.config_parse", ("core: base", 0)),
    ("flame_llm.sampling_params", ("core: base", 0)),
    ("flame_llm.outputs", ("core: base", 0)),
    ("flame_llm.prefix", ("core: base", 0)),
    ("flame_llm.limits", ("core: base", 0)),
    ("flame_llm.validate", ("core: base", 0)),
    ("flame_llm.fair_queue", ("core: base", 0)),
    ("flame_llm.kernels", ("core: kernels", 1)),
    ("flame_llm.layers", ("core: layers", 2)),
    ("flame_llm.models", ("core: models", 3)),
    ("flame_llm.engine", ("core: engine", 4)),
    ("flame_llm.protocol", ("protocol", 5)),
    ("actors", ("serving: shards", 6)),
    ("router", ("serving: shards", 6)),
    ("flame_llm.serving", ("serving", 7)),
    ("flame_llm.cli", ("app", 8)),
    ("flame_llm.cli_serve", ("app", 8)),
    ("flame_llm.cli_demo", ("app", 8)),
    ("bench", ("bench", 9)),
]


def layer_of(module: str) -> tuple[str, int] | None:
    best = None
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, layer)
    return None if best is None else best[1]


def modules() -> dict[str, str]:
    """module name -> file path, for every .py file of the four import packages."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            if "results" in dirpath.split(os.sep):
                continue
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].split(os.sep)
                    if rel[-1] == "__init__":
                        rel = rel[:-1]
                    out[".".join(rel)] = os.path.join(dirpath, f)
    return out


def imports_of(path: str, known: dict[str, str]) -> set[str]:
    """The project modules a file imports (a name imported from a package counts as its submodule
    when one exists, else the package)."""
    tree = ast.parse(open(path).read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports_of(p, known) - {m} for m, p in known.items()}


def test_every_module_has_a_layer():
    assert [m for m in modules() if layer_of(m) is None] == []


def test_imports_only_go_down_the_layers():
    upward = []
    for module, deps in graph().items():
        (name, rank) = layer_of(module)
        for dep in deps:
            dep_name, dep_rank = layer_of(dep)
            if dep_rank > rank:
                upward.append(f"{module} ({name}) imports {dep} ({dep_name})")
    assert upward == []


def test_no_import_cycles():
    g = graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g[v]:
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
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_checker_sees_an_upward_import(tmp_path):
    """The checker itself: a kernels module importing the engine is reported."""
    known = {"flame_llm.kernels.bad": str(tmp_path / "bad.py"), "flame_llm.engine.model_runner": ""}
    (tmp_path / "bad.py").write_text("def f():\n    from flame_llm.engine.model_runner import ModelRunner\n")
    deps = imports_of(known["flame_llm.kernels.bad"], known)
    assert deps == {"flame_llm.engine.model_runner"}
    assert layer_of("flame_llm.engine.model_runner")[1] > layer_of("flame_llm.kernels.bad")[1]
