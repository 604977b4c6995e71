"""Loaded at every interpreter start in an environment where fedcontrast is installed (by the file
``fedcontrast_fx_guard.pth``); does nothing unless this process is ``fx collaborator start`` (or
``fx aggregator start``, whose plan file is read first so that a broken one is one sentence).

Then, before OpenFL puts the workspace first on ``sys.path`` and imports the plan's components, the
workspace and its plan are checked (:func:`fedcontrast.site.guard.guard_collaborator_start`):
no Python file in the workspace, only installed components, TLS on unless the site's policy allows
otherwise. A refusal is one sentence on standard error and exit code 1.
"""

import os
import sys


def _starting(argv):
    """"collaborator" or "aggregator" when this process is ``fx collaborator|aggregator start``, else None."""
    if not argv or os.path.basename(argv[0]) != "fx":
        return None
    args = argv[1:]
    for party in ("collaborator", "aggregator"):
        if party in args and args[args.index(party) + 1:args.index(party) + 2] == ["start"]:
            return party
    return None


def _refuse(party, message):
    """One sentence on standard error and exit code 1, before fx has done anything."""
    sys.stderr.write(f"fedcontrast {party}: error: {message}\n")
    sys.stderr.flush()
    os._exit(1)


def _guard():
    argv = list(getattr(sys, "argv", None) or [])
    party = _starting(argv)
    if party is None:
        return
    if party == "aggregator":  # the operator's own code: only a plan fx would stop on with a traceback is named
        try:
            from fedcontrast.errors import FedContrastError
            from fedcontrast.site.guard import guard_aggregator_start

            guard_aggregator_start(argv, os.getcwd())
        except FedContrastError as exc:
            _refuse(party, str(exc))
        except Exception:  # anything else is left to fx and fedcontrast's aggregator, which say it themselves
            pass
        return
    try:
        from fedcontrast.errors import FedContrastError
        from fedcontrast.site.guard import guard_collaborator_start
    except Exception as exc:  # fedcontrast half-installed: refuse rather than run unchecked
        _refuse(party, f"the workspace cannot be checked ({exc}); reinstall fedcontrast")
    try:
        guard_collaborator_start(argv, os.getcwd())
    except FedContrastError as exc:
        _refuse(party, str(exc))
    except Exception as exc:
        _refuse(party, f"the workspace could not be checked ({type(exc).__name__}: {exc}); nothing was run")


def _flower_app_bundles():
    """The folder where a SuperNode installs the operator's app bundles (FABs): FLWR_HOME/apps."""
    home = os.environ.get("FLWR_HOME") or os.path.join(os.path.expanduser("~"), ".flwr")
    return os.path.realpath(os.path.join(home, "apps"))


class _NoBundleCode:
    """A meta path finder for a site's ``flwr-clientapp`` processes: a module found inside an app bundle
    the operator sent is refused; the ClientApp a site runs is the fedcontrast it installed itself."""

    def __init__(self, bundles):
        from importlib.machinery import PathFinder  # here: an import inside find_spec would call find_spec

        self.bundles, self.finder = bundles + os.sep, PathFinder

    def find_spec(self, name, path=None, target=None):
        spec = self.finder.find_spec(name, path)
        origin = getattr(spec, "origin", None) or ""
        locations = list(getattr(spec, "submodule_search_locations", None) or [])
        if any(os.path.realpath(p).startswith(self.bundles) for p in [origin, *locations] if p):
            _refuse("flower site", f"the operator's Flower app bundle carries code ({name}, in "
                                   f"{os.path.dirname(origin) or locations[0]}): this site runs only the fedcontrast "
                                   "it installed itself; nothing of the bundle was run")
        return None  # found normally by the finders after this one


def _guard_flower_site():
    """In a ClientApp process of a SuperNode started by ``fedcontrast flower supernode`` (which sets
    FEDCONTRAST_FLOWER_SITE=1): no module of the operator's app bundle is ever imported."""
    argv = list(getattr(sys, "argv", None) or [])
    if not argv or os.path.basename(argv[0]) != "flwr-clientapp" or os.environ.get("FEDCONTRAST_FLOWER_SITE") != "1":
        return
    sys.meta_path.insert(0, _NoBundleCode(_flower_app_bundles()))


_guard()
_guard_flower_site()
