"""One module per encoding (docs/FORMAT.md §5); importing this package registers them all.

Every module of this package is imported, so an encoding added here needs no line elsewhere.
"""

from __future__ import annotations

import importlib
import pkgutil

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")
