"""Which code a federation runs: the distributions (and versions) of fedcontrast, of the third-party
plugin that provides the plan's algorithm, and of the libraries every party's training goes through.

A workspace's ``requirements.txt`` pins them (``fedcontrast workspace create`` writes it, every party
installs it); the audit shows the pins beside what this machine runs, so a privacy officer approves
code as well as numbers, and a site refuses a package that pins code it does not run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, packages_distributions, version

CORE = "fedcontrast"
LIBRARIES = ("openfl", "torch", "opacus")  # what training, transport and DP go through (installed by fedcontrast)


@dataclass(frozen=True)
class CodeLine:
    distribution: str
    role: str
    installed: str | None  # on this machine; None: not installed here
    pinned: str | None  # in the workspace's requirements.txt; None: not pinned (or no workspace)

    @property
    def mismatch(self) -> bool:
        return self.pinned is not None and self.installed != self.pinned

    def to_dict(self) -> dict:
        return asdict(self)


def installed_version(distribution: str) -> str | None:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def algorithm_distribution(algorithm: str) -> str:
    """The distribution that provides the registered algorithm ``algorithm`` (fedcontrast for built-ins)."""
    from .algorithms import get_algorithm

    top = get_algorithm(algorithm).__module__.split(".")[0]
    if top == CORE:
        return CORE
    owners = packages_distributions().get(top) or []
    return owners[0] if owners else top


def requirement_pins(lines: list[str]) -> dict[str, str]:
    """``NAME==VERSION`` lines of a requirements file as {name: version} (other lines ignored)."""
    pins = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        name, sep, pinned = line.partition("==")
        if sep and name.strip() and pinned.strip():
            pins[name.strip().lower().replace("_", "-")] = pinned.strip()
    return pins


def read_requirements(path) -> list[str] | None:
    from pathlib import Path

    from .yamlio import read_text

    path = Path(path)
    return read_text(path, "requirements file").splitlines() if path.is_file() else None


def code_lines(algorithm: str, requirements: list[str] | None = None) -> list[CodeLine]:
    """fedcontrast, the algorithm's plugin distribution (when third-party) and the libraries, each with
    the version installed here and the one ``requirements`` pins."""
    pins = requirement_pins(requirements or [])
    plugin = algorithm_distribution(algorithm)
    rows = [(CORE, f"the algorithms, the site's checks and the engine adapter (algorithm {algorithm!r} built in)"
             if plugin == CORE else "the site's checks and the engine adapter")]
    if plugin != CORE:
        rows.append((plugin, f"third-party plugin providing algorithm {algorithm!r}"))
    rows += [(lib, "library") for lib in LIBRARIES]
    return [CodeLine(d, role, installed_version(d), pins.get(d.lower().replace("_", "-"))) for d, role in rows]


def requirements_text(algorithm: str) -> str:
    """A workspace's ``requirements.txt``: fedcontrast, the algorithm's plugin and the libraries (those
    installed here: OpenFL, torch, Opacus), each pinned as installed here, as the audit's code table lists them."""
    from . import __version__

    lines = ["# What every party installs before running this workspace (`fx workspace export` ships this file);",
             "# each site checks that it runs exactly these versions, and the audit lists them.",
             f"{CORE}=={__version__}"]
    plugin = algorithm_distribution(algorithm)
    if plugin != CORE and installed_version(plugin) is not None:
        lines.append(f"{plugin}=={installed_version(plugin)}")
    lines += [f"{lib}=={installed_version(lib)}" for lib in LIBRARIES if installed_version(lib) is not None]
    return "\n".join(lines) + "\n"
