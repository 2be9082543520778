"""Swap a module that another module imported for a stand-in object, for that module only.

ppoflow adjusts two things inside Prefect this way (adaptations/prefect_client.py: `ssl` in its client module;
adaptations/prefect_server.py: `subprocess` in its server module): the stand-in wraps one function of the real
module and hands every other attribute to it, so nothing else in the process sees a change.
"""

from __future__ import annotations

from types import ModuleType


def install_stand_in(owner: ModuleType, name: str, real: ModuleType, stand_in: type) -> bool:
    """Set `owner.<name>` to `stand_in()` where it is the module `real`. True when installed, or when a `stand_in`
    is there already (idempotent); False, changing nothing, when `owner.<name>` is anything else: the owner no
    longer looks as expected (a Prefect release that moved the import) and is left as it is."""
    current = getattr(owner, name, None)
    if isinstance(current, stand_in):
        return True
    if current is not real:
        return False
    setattr(owner, name, stand_in())
    return True
