"""The scripts under tools/ as modules, for tests that call their functions rather than start a process."""
import importlib
import os
import sys

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


def load_tool(name: str):
    """``tools/<name>.py`` imported under its own name, with tools/ on the path as when it runs as a script (the
    tools import their helper modules, e.g. ``preprocessing``, by name; pool workers find them so too). tools/ goes
    last on the path, so it shadows no installed package; a name that resolves elsewhere is an error."""
    if TOOLS not in sys.path:
        sys.path.append(TOOLS)
    module = importlib.import_module(name)
    if os.path.dirname(os.path.abspath(module.__file__)) != TOOLS:
        raise ImportError(f"'{name}' resolves to {module.__file__}, not tools/{name}.py: rename the tool")
    return module
