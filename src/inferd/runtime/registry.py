"""The model registry: model name -> served versions -> runtime, and which version answers unversioned
requests. Built once by the composition root (server.py); every other module finds runtimes here."""

from __future__ import annotations

from collections.abc import Iterator

from inferd.errors import NotFound
from inferd.runtime.contract import Runtime


class ModelRegistry:
    def __init__(self) -> None:
        self._models: dict[str, dict[int, Runtime]] = {}
        self._defaults: dict[str, int] = {}
        """Pinned default versions (default_version, or an update); else the highest served one."""

    # ---- building and changing ----------------------------------------------------------------------
    def add(self, runtime: Runtime) -> None:
        versions = self._models.setdefault(runtime.name, {})
        if runtime.version in versions:
            raise ValueError(f"model {runtime.name!r} version {runtime.version} is registered twice")
        versions[runtime.version] = runtime
        if runtime.config.default_version is not None:
            self._defaults[runtime.name] = runtime.config.default_version

    def remove(self, name: str, version: int) -> Runtime:
        runtime = self.get(name, version)
        del self._models[name][version]
        if self._defaults.get(name) == version:
            del self._defaults[name]
        return runtime

    def set_default(self, name: str, version: int) -> None:
        self.get(name, version)
        self._defaults[name] = version

    # ---- finding --------------------------------------------------------------------------------------
    def get(self, name: str, version: int | str | None = None) -> Runtime:
        """The runtime serving `name` at `version` (None: the default version). Raises NotFound naming
        what is served."""
        versions = self._models.get(name)
        if not versions:
            raise NotFound(f"unknown model {name!r}; served models: {self.names()}")
        if version is None:
            return versions[self.default_version(name)]
        number = _version_number(version)
        if number not in versions:
            raise NotFound(
                f"model {name!r} version {version!r} is not served (served versions: {sorted(versions)})"
            )
        return versions[number]

    def default_version(self, name: str) -> int:
        versions = self._models.get(name)
        if not versions:
            raise NotFound(f"unknown model {name!r}; served models: {self.names()}")
        pinned = self._defaults.get(name)
        return pinned if pinned in versions else max(versions)

    def versions(self, name: str) -> list[int]:
        return sorted(self._models.get(name, {}))

    def names(self, kinds: frozenset[str] | None = None) -> list[str]:
        """The served models' names; `kinds`: only those of these kinds (e.g. `KindRegistry.serving`)."""
        return sorted(
            name
            for name, versions in self._models.items()
            if versions and (kinds is None or any(rt.kind in kinds for rt in versions.values()))
        )

    def __iter__(self) -> Iterator[Runtime]:
        """Every served runtime, by model name then version."""
        for name in sorted(self._models):
            for version in sorted(self._models[name]):
                yield self._models[name][version]

    def defaults(self) -> Iterator[Runtime]:
        """Each model's default-version runtime."""
        for name in self.names():
            yield self.get(name)

    def __contains__(self, name: object) -> bool:
        return bool(self._models.get(name)) if isinstance(name, str) else False


def _version_number(version: int | str) -> int:
    if isinstance(version, int):
        return version
    if not (version.isascii() and version.isdigit()):  # int() refuses '\u00b2', a digit to isdigit()
        raise NotFound(f"model version {version!r} is not a version number")
    return int(version)
