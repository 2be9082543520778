"""Find the environment factory a config names, and the identity that goes into the rollout's cache key.

A spec is "pkg.module:Factory" (importable) or "path/to/file.py:Factory" (a file), imported by the same rule
as reward functions (engines/rewards/function.py `load_by_spec`). The factory is anything that, called with
no arguments, builds one Environment (engines/environments/base.py): a class, or a function returning an
instance. It is called once per sample, in the rollout worker.

The identity is sha256 of the spec, the whole file the factory lives in (the file a "path.py:Factory" spec
names, or the module's file) and the versions of the packages the factory declares in an
`identity_packages` attribute (a library adapter declares its library, whose code that file does not
hold): editing the environment's file or upgrading its library changes the key, so cached rollouts made by
the old environment are not reused. Where there is no file, the reward functions' `function_identity`
(the factory's own source) stands in.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from dataclasses import dataclass
from typing import Callable

from engines.environments.base import Environment
from engines.rewards.function import function_identity, load_by_spec, spec_file


@dataclass(frozen=True)
class EnvironmentFactory:
    """The environment named by `spec`: `make()` builds a fresh one; `identity` is 16 hex characters."""

    spec: str
    make: Callable[[], Environment]
    identity: str


def load_environment_factory(spec: str) -> EnvironmentFactory:
    """The factory named by `spec`, with its identity.

    Raises ValueError (malformed spec), FileNotFoundError, ImportError, AttributeError or TypeError (not
    callable), each naming "environment" and the spec. Whether what it builds meets the contract is checked
    per call, by CheckedEnvironment (engines/environments/checked.py), which names the row and the turn too.
    """
    make = load_by_spec(spec, "environment")
    return EnvironmentFactory(spec=spec, make=make, identity=environment_identity(spec, make))


def environment_identity(spec: str, make: Callable) -> str:
    """sha256 over the spec, the factory's file (module docstring) and its `identity_packages`' versions."""
    file = spec_file(spec)
    code = file.read_text() if file is not None else function_identity(spec, make)
    packages = tuple(getattr(make, "identity_packages", ()))
    versions = [f"{name}=={_version(name)}" for name in sorted(packages)]
    return hashlib.sha256("\n".join([spec, code, *versions]).encode()).hexdigest()[:16]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
