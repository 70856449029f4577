"""The solver methods. Importing this package registers every module's methods."""

import importlib
import pkgutil

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")

from solver.methods.auto import solve_auto as _solve_auto  # noqa: E402
from solver.registry import register as _register  # noqa: E402

# ``auto`` picks among the others (it reads the table at call time): registered here,
# once they all are
_register("auto", family="portfolio", order="free")(_solve_auto)
