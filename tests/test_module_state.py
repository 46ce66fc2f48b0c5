"""No module-level mutable state in the library but caches of pure facts and what is one per process by nature: every
module global that a function assigns (``global``) or mutates (``x.append``, ``x[k] = ``, ``next(x)``, ...) is
listed below with why, and a new one fails this test (a run's state belongs to an object the run owns)."""
import ast
import os

from tests.fake_cuda import REPO

PACKAGE = os.path.join(REPO, "megatron_domino")
MUTATORS = {"append", "add", "update", "clear", "pop", "setdefault", "extend", "remove", "discard", "insert",
            "popitem"}
ALLOWED = {
    "mpu.py": ({"_current", "_owned"}, "Megatron's mpu API is process-wide by definition"),
    "parallel/attempt.py": ({"_current", "_agreed"}, "the process's own launch attempt under torchrun"),
    "parallel/device.py": ({"_runtime"}, "the CUDA runtime is one per process; a rehearsal installs its stand-in"),
    "parallel/strict.py": ({"_installed"}, "torch.distributed's functions, wrapped once per process (debugging)"),
    "rehearsal/fake_cuda.py": ({"_loaded"}, "the fake CUDA library, loaded into the process once"),
    "rehearsal/shadows.py": ({"_WRITES"}, "a cache of the ops' schemas"),
    "fp8/grouped_kernel.py": ({"_refused"}, "a cache of the weight shapes CUDA's kernel refused"),
    "fp8/native_blockwise.py": ({"_refused"}, "a cache of the shapes CUDA's kernel refused"),
    "pipeline/schedules/__init__.py": ({"SCHEDULES"}, "the registry of schedule records, filled at import"),
}


def _module_names(tree) -> set[str]:
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _changed_in_functions(tree, names: set[str]) -> set[str]:
    changed = set()
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Global):
                changed |= set(node.names)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(
                    node.func.value, ast.Name) and node.func.attr in MUTATORS:
                changed.add(node.func.value.id)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "next" and node.args and isinstance(
                    node.args[0], ast.Name):
                changed.add(node.args[0].id)
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                        changed.add(target.value.id)
    return changed & names


def test_module_globals_change_only_where_listed():
    found = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                changed = _changed_in_functions(tree, _module_names(tree))
                if changed:
                    found[os.path.relpath(path, PACKAGE)] = changed
    unexplained = {module: names - ALLOWED.get(module, (set(), ""))[0] for module, names in found.items()}
    unexplained = {module: names for module, names in unexplained.items() if names}
    assert not unexplained, f"module state a run should own: {unexplained}"
    stale = {module for module, (names, _) in ALLOWED.items() if not names <= found.get(module, set())}
    assert not stale, f"allowed module state that is gone (remove it from ALLOWED): {stale}"
