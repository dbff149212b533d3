"""Old import paths of modules that moved to another folder.

`install({"diag.engine": "diag.arithmetic.engine"})` makes `import diag.engine` and
`from diag.engine import X` give the moved module itself, imported on first use: one module
object under both names, so code written against the old path (and a test patching it) keeps
working, and importing the package stays as light as before.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, moved: dict[str, str]) -> None:
        self.moved = moved
        self.own_specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name in self.moved else None

    def create_module(self, spec) -> ModuleType:
        module = importlib.import_module(self.moved[spec.name])
        self.own_specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import machinery set the old name's spec on the module: give it back its own.
        module.__spec__ = self.own_specs[module.__name__]


def install(moved: dict[str, str]) -> None:
    """Serve each old name of `moved` (old dotted name -> new one) from its new module."""
    sys.meta_path.append(_MovedModules(moved))
