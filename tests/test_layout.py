"""The shape of the code, read with ``ast``: imports go one way, without circles.

Entry scripts and the side programs (tools/) -> your files (model.py, my_dataset.py, utils.py) ->
the engine: the recipe's steps (multi_train_utils/) -> base modules (errors and signals, file
writing and train.log, the process group, the image pipeline, the datasets and their files). The engine never imports your files. A module may
import from its own layer or the ones below, never above; no project import hides inside a
function; every module opens with a one-line docstring; utils.py stays small;
train_multi_gpu.py is train_single.py plus its DDP steps; no call passes more than 5
positional arguments; no function runs over 60 lines (the argument parser and the entry
scripts' main: 120).
"""
import ast
import os

from conftest import REPO

ENTRY_SCRIPTS = {"train_single", "train_multi_gpu", "predict", "export", "benchmark"}
SHARED = {"model", "my_dataset", "utils"}
BASE = {"multi_train_utils", "multi_train_utils.errors", "multi_train_utils.distributed_utils", "multi_train_utils.files",
        "multi_train_utils.datasets", "multi_train_utils.images"}
ENTRY, SHARED_LAYER, STEPS, BASE_LAYER = 3, 2, 1, 0


def project_modules():
    """{module name: path} of the project's own Python files (tests left out)."""
    modules = {}
    for name in os.listdir(REPO):
        if name.endswith(".py"):
            modules[name[:-3]] = os.path.join(REPO, name)
    for package_name in ("multi_train_utils", "tools"):
        package = os.path.join(REPO, package_name)
        for name in os.listdir(package):
            if name.endswith(".py"):
                module = package_name if name == "__init__.py" else f"{package_name}.{name[:-3]}"
                modules[module] = os.path.join(package, name)
    return modules


def layer_of(module):
    if module in ENTRY_SCRIPTS or module.split(".")[0] == "tools":  # programs of their own
        return ENTRY
    if module in SHARED:
        return SHARED_LAYER
    if module in BASE:
        return BASE_LAYER
    assert module.startswith("multi_train_utils."), f"{module}.py: a new top-level module; give it a layer here"
    return STEPS


def project_imports(module, path, modules):
    """[(imported module, line, inside a function)] of ``module``, the file at ``path``."""
    found = []
    package = module if module == "multi_train_utils" else module.rpartition(".")[0]

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                # relative imports: "from .pictures import x" in multi_train_utils/
                base = (child.module or "") if child.level == 0 else ".".join(
                    filter(None, [package.rsplit(".", child.level - 1)[0] if package else "", child.module]))
                # "from multi_train_utils import pictures" imports the module pictures
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in child.names]
            found.extend((name, child.lineno, inside) for name in names if name in modules)
            visit(child, inside)

    with open(path) as f:
        visit(ast.parse(f.read()), False)
    return found


def import_graph():
    modules = project_modules()
    return modules, {name: project_imports(name, path, modules) for name, path in modules.items()}


def test_imports_go_one_way_and_none_hides_in_a_function():
    modules, graph = import_graph()
    assert {"train_single", "train_multi_gpu", "model", "utils", "multi_train_utils.train_eval_utils"} <= set(modules)
    problems = []
    for module, imports in graph.items():
        for target, line, in_function in imports:
            where = f"{os.path.relpath(modules[module], REPO)}:{line}"
            if in_function:
                problems.append(f"{where}: imports {target} inside a function")
            if layer_of(target) > layer_of(module):
                problems.append(f"{where}: {module} (layer {layer_of(module)}) imports {target} "
                                f"(layer {layer_of(target)}), a layer above it")
    assert not problems, "\n".join(problems)


def test_the_import_graph_has_no_circles():
    _, graph = import_graph()
    edges = {module: sorted({target for target, _, _ in imports}) for module, imports in graph.items()}
    state, path = {}, []

    def visit(module):  # depth-first; a module met again while still open closes a circle
        state[module] = "open"
        path.append(module)
        for target in edges[module]:
            if state.get(target) == "open":
                circle = path[path.index(target):] + [target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)


def test_every_module_opens_with_a_one_line_docstring():
    for module, path in project_modules().items():
        with open(path) as f:
            docstring = ast.get_docstring(ast.parse(f.read()))
        assert docstring, f"{module}: no module docstring"
        summary = docstring.split("\n\n")[0]
        assert "\n" not in summary and summary.endswith((".", ":")), \
            f"{module}: the docstring's first paragraph is not one line: {summary!r}"


def test_utils_stays_small():
    with open(os.path.join(REPO, "utils.py")) as f:
        assert len(f.readlines()) < 300


def main_code_lines(name):
    """The code lines of ``name``'s main(), stripped (comments and blank lines left out)."""
    with open(os.path.join(REPO, name)) as f:
        source = f.read()
    main = next(node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == "main")
    lines = source.splitlines()[main.lineno:main.end_lineno]
    return [line.split("  # ")[0].strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def test_train_multi_gpu_is_train_single_plus_its_ddp_steps():
    """Every line of train_single.py's main, but for at most 5 (the flags, train.log, the stop
    handlers, the device, the threads), is a line of train_multi_gpu.py's main too: the
    recipe is the same lines, and a diff of the two shows the DDP steps."""
    single, multi = main_code_lines("train_single.py"), set(main_code_lines("train_multi_gpu.py"))
    only_single = [line for line in single if line not in multi]
    assert len(single) > 40 and len(only_single) <= 5, only_single


def test_no_call_passes_more_than_5_positional_arguments():
    problems = []
    for module, path in project_modules().items():
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and sum(not isinstance(a, ast.Starred) for a in node.args) > 5:
                problems.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: {ast.unparse(node.func)}(...) takes "
                                f"{len(node.args)} positional arguments")
    assert not problems, "\n".join(problems)


def test_functions_are_at_most_60_lines_the_parser_and_the_mains_at_most_120():
    long_allowed = {"get_args_parser", "main"}
    problems = []
    for module, path in project_modules().items():
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = 120 if node.name in long_allowed else 60
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    problems.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: {node.name} is {length} lines")
    assert not problems, "\n".join(problems)


def outside_main_lines(name):
    """The stripped code lines of ``name`` outside main() (no imports, comments or blank lines)."""
    with open(os.path.join(REPO, name)) as f:
        source = f.read()
    main = next(node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == "main")
    lines = source.splitlines()
    kept = lines[:main.lineno - 1] + lines[main.end_lineno:]
    return [line.strip() for line in kept
            if line.strip() and not line.strip().startswith(("from ", "import ", "#"))]


def test_the_training_scripts_repeat_no_logic_outside_main():
    """What the two scripts share beyond main's recipe lines lives once, in a module: outside
    main they share no run of 5 identical lines (a helper copied into both, say)."""
    single, multi = outside_main_lines("train_single.py"), outside_main_lines("train_multi_gpu.py")
    runs = {tuple(single[i:i + 5]) for i in range(len(single) - 4)}
    shared = [multi[i:i + 5] for i in range(len(multi) - 4) if tuple(multi[i:i + 5]) in runs]
    assert not shared, f"train_single.py and train_multi_gpu.py share: {shared[0]}"
