"""Loaded at every interpreter start in an environment where fedcontrast is installed (by the file
``fedcontrast_fx_guard.pth``), and by torch at its import (the entry point ``torch.backends`` →
``_fedcontrast_torch_guard``, which runs even under ``python -S``): it makes the site's checks run
wherever OpenFL starts a collaborator or aggregator, whatever the launcher is called.

* A meta path finder watches for OpenFL. When a process first imports ``openfl`` and its arguments say
  ``collaborator start`` (or ``aggregator start``) — ``fx``, a link to ``fx`` under another name,
  ``python -m openfl.interface.cli``, ``python -c ...`` — the workspace and its plan are checked
  (:func:`fedcontrast.openfl.guard.guard_collaborator_start`) before OpenFL puts the workspace first on
  ``sys.path`` and imports anything from it: no Python file in the workspace, only installed
  components, TLS on unless the site's policy allows otherwise.
* When OpenFL's plan machinery (``openfl.federated.plan.plan``) is imported, ``Plan.get_collaborator``
  and ``Plan.get_aggregator`` are wrapped: every program that builds a party from a plan, whatever
  started it, is checked before the plan's first component is imported; and the plan dump its
  ``Plan.parse`` logs goes to a file, one line with its path and hash to the log
  (:mod:`fedcontrast.openfl.plan_log`).
* Every plan component, however it is reached: ``Plan.build`` and ``Plan.import_`` — what every
  ``get_*`` (data loader, task runner, assigner, pipeline, aggregation functions, straggler policy…)
  and any program calling them directly goes through — build only accepted components
  (:func:`fedcontrast.openfl.guard.component_refusal`: fedcontrast's own, an installed plugin's,
  OpenFL's defaults for sections a fedcontrast plan leaves out), and a component of a parsed plan
  only when the whole plan passes; and once ``Plan.parse`` has read a plan, the modules of its
  other components are never imported by any route (``fx plan initialize`` imports the data loader
  with importlib itself): the watcher below refuses them
  (:func:`fedcontrast.openfl.guard.foreign_modules`).

A refusal is one sentence on standard error and exit code 1 under OpenFL's command line (any ``fx``
command: ``collaborator start``, ``plan initialize``…); a program that builds a component itself gets
:class:`fedcontrast.deploy.trust.PackageRefused` instead. Outside what a site can be
protected from: an interpreter that loads neither site-packages' ``.pth`` files nor torch's entry
points (``python -S`` without fedcontrast's environment, or with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``).
"""

import os
import sys
import weakref

PLAN_MODULE = "openfl.federated.plan.plan"
_state = {"argv_checked": False}
_checked: set[tuple] = set()  # (party, cwd, plan, data config, name) already checked in this process
_parsed: list = []  # weak references to the plans Plan.parse read that the guard refuses


def _starting(argv):
    """"collaborator" or "aggregator" when this process's arguments (after the program, whatever it is
    called: fx, a renamed link, ``-m`` or ``-c``) say ``collaborator start`` / ``aggregator start``."""
    args = list(argv[1:]) if argv else []
    for party in ("collaborator", "aggregator"):
        if party in args and args[args.index(party) + 1:args.index(party) + 2] == ["start"]:
            return party
    return None


def _refuse(party, message):
    """One sentence on standard error and exit code 1, before fx has done anything."""
    sys.stderr.write(f"fedcontrast {party}: error: {message}\n")
    sys.stderr.flush()
    os._exit(1)


class _WithoutWorkingDirectory:
    """fedcontrast's own modules, never the workspace's: ``python -m`` and ``-c`` put the working
    directory (the workspace) first on ``sys.path``, where a ``fedcontrast/`` folder would replace the guard."""

    def __enter__(self):
        self.saved, cwd = sys.path[:], os.getcwd()
        sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != cwd]

    def __exit__(self, *exc):
        sys.path[:] = self.saved


def _guard():
    """The checks of ``fx collaborator|aggregator start`` (any launcher), from this process's arguments."""
    argv = list(getattr(sys, "argv", None) or [])
    party = _starting(argv)
    if party is None:
        return
    argv = ["fx", *argv[1:]]  # the command line as fx reads it, whatever started this process
    with _WithoutWorkingDirectory():
        _check(party, argv, None)


def _check(party, argv, plan):
    """Run the checks for ``party`` (from ``argv``, or, with ``plan``, from OpenFL's Plan object)."""
    if party == "aggregator":  # the operator's own code: only a plan fx would stop on with a traceback is named
        try:
            from fedcontrast.errors import FedContrastError
            from fedcontrast.openfl.guard import guard_aggregator_plan, guard_aggregator_start
        except Exception:  # left to fx and fedcontrast's aggregator, which say it themselves
            return
        try:
            guard_aggregator_start(argv, os.getcwd()) if plan is None else guard_aggregator_plan(plan[0], os.getcwd())
        except FedContrastError as exc:
            _refuse_or_raise(party, exc, plan)
        except Exception:  # anything else is left to fx and fedcontrast's aggregator, which say it themselves
            pass
        return
    try:
        from fedcontrast.errors import FedContrastError
        from fedcontrast.openfl.guard import guard_collaborator_plan, guard_collaborator_start
    except Exception as exc:  # fedcontrast half-installed: refuse rather than run unchecked
        _refuse(party, f"the workspace cannot be checked ({exc}); reinstall fedcontrast")
    try:
        if plan is None:
            guard_collaborator_start(argv, os.getcwd())
        else:
            plan_path, data_path, name, built = plan
            guard_collaborator_plan(plan_path, data_path, name, built, os.getcwd())
    except FedContrastError as exc:
        _refuse_or_raise(party, exc, plan)
    except Exception as exc:
        if plan is not None and _starting(list(getattr(sys, "argv", None) or [])) is None:
            raise
        _refuse(party, f"the workspace could not be checked ({type(exc).__name__}: {exc}); nothing was run")


def _fx_command(argv):
    """The command OpenFL's command line runs in this process (``plan initialize``), or None when this
    process is not OpenFL's command line (``fx``, a link to it, ``python -m openfl.interface.cli``)."""
    main = sys.modules.get("__main__")
    entry = getattr(main, "entry", None)
    cli = (getattr(getattr(main, "__spec__", None), "name", None) == "openfl.interface.cli"
           or getattr(entry, "__module__", None) == "openfl.interface.cli"
           or (bool(argv) and os.path.basename(str(argv[0])) == "fx"))
    if not cli:
        return None
    words = [a for a in argv[1:] if not a.startswith("-")][:2]
    return " ".join(words) or "command"


def _refuse_component(message):
    """A plan component refused: one sentence and exit 1 under OpenFL's command line, else raised as
    :class:`~fedcontrast.deploy.trust.PackageRefused` to the program that builds it."""
    argv = list(getattr(sys, "argv", None) or [])
    party, command = _starting(argv), _fx_command(argv)
    if party is not None or command is not None:
        _refuse(party or f"fx {command}", message)
    try:
        with _WithoutWorkingDirectory():
            from fedcontrast.deploy.trust import PackageRefused
    except Exception:  # fedcontrast half-installed: still refused
        raise ImportError(message) from None
    raise PackageRefused(message)


def _refuse_or_raise(party, exc, plan):
    """Under a start command: one sentence and exit 1; in a program that builds the party itself: raise."""
    if plan is None or _starting(list(getattr(sys, "argv", None) or [])) is not None:
        _refuse(party, str(exc))
    raise exc


# --- OpenFL's plan machinery: every program that builds a party from a plan ---------------------------
def _patch_plan(plan_class):
    """Wrap ``Plan.parse`` (to know the plan's files), ``Plan.get_collaborator`` and ``Plan.get_aggregator``
    (to check them before the plan's first component is imported)."""
    if getattr(plan_class, "_fedcontrast_guarded", False):
        return
    import inspect

    parse = plan_class.parse
    signature = inspect.signature(parse)

    def guarded_parse(*args, **kwargs):
        plan = parse(*args, **kwargs)
        try:
            given = signature.bind(*args, **kwargs).arguments
            plan._fedcontrast_files = (given.get("plan_config_path"), given.get("data_config_path"))
        except (TypeError, AttributeError):
            pass
        _remember_foreign(plan)
        return plan

    build, import_ = plan_class.build, plan_class.import_

    def guarded_build(template, settings, **override):
        _check_component(template, settings)
        return build(template, settings, **override)

    def guarded_import(template):
        _check_component(template, None)
        return import_(template)

    get_collaborator, get_aggregator = plan_class.get_collaborator, plan_class.get_aggregator

    def guarded_get_collaborator(self, collaborator_name, *args, **kwargs):
        _check_plan(self, "collaborator", collaborator_name)
        return get_collaborator(self, collaborator_name, *args, **kwargs)

    def guarded_get_aggregator(self, *args, **kwargs):
        _check_plan(self, "aggregator", None)
        return get_aggregator(self, *args, **kwargs)

    _plan_dump_to_file()
    plan_class.parse = staticmethod(guarded_parse)
    plan_class.build = staticmethod(guarded_build)
    plan_class.import_ = staticmethod(guarded_import)
    plan_class.get_collaborator = guarded_get_collaborator
    plan_class.get_aggregator = guarded_get_aggregator
    plan_class._fedcontrast_guarded = True


def _plan_dump_to_file():
    """OpenFL's plan dump (~130 lines of every party's log) goes to a file, its path and hash to the log
    (:mod:`fedcontrast.openfl.plan_log`); left as it is where fedcontrast cannot be imported."""
    try:
        with _WithoutWorkingDirectory():
            from fedcontrast.openfl.plan_log import PlanDumpToFile
        PlanDumpToFile.install()
    except Exception:
        pass


def _plan_source(plan):
    files = getattr(plan, "_fedcontrast_files", None) or (None, None)
    return os.path.abspath(str(files[0] or os.path.join("plan", "plan.yaml")))


def _remember_foreign(plan):
    """After ``Plan.parse``: the modules of the plan's components that are not accepted, which the
    watcher then refuses to import by any route, with the sentence that names them."""
    try:
        with _WithoutWorkingDirectory():
            from fedcontrast.openfl.guard import foreign_modules, plan_refusal
        config = getattr(plan, "config", None)
        refusal = plan_refusal(config, _plan_source(plan))
        if refusal is None:
            return
        plan._fedcontrast_foreign = (frozenset(foreign_modules(config)), refusal)
    except Exception:  # fedcontrast cannot be imported: Plan.build refuses every component then
        return
    _parsed[:] = [ref for ref in _parsed if ref() is not None] + [weakref.ref(plan)]


def _foreign_import(name):
    """The sentence refusing to import module ``name``, named by a component of a plan OpenFL parsed."""
    for ref in list(_parsed):
        plan = ref()
        foreign = getattr(plan, "_fedcontrast_foreign", None)
        if foreign is not None and name in foreign[0]:
            return foreign[1]
    return None


def _owner(settings):
    """The refused plan (one ``Plan.parse`` read, :func:`_remember_foreign`) whose configuration holds
    ``settings`` — the very dict OpenFL's ``get_*`` passes to ``Plan.build`` —, or None."""
    if not isinstance(settings, dict):
        return None

    def holds(node, depth):
        if not isinstance(node, dict) or depth > 4:
            return False
        if node.get("settings") is settings:
            return True
        return any(holds(value, depth + 1) for value in node.values() if isinstance(value, dict))

    for plan in [ref() for ref in _parsed]:
        if plan is not None and holds(getattr(plan, "config", None), 0):
            return plan
    return None


def _check_component(template, settings):
    """Before ``Plan.build`` / ``Plan.import_`` imports ``template``'s module."""
    try:
        with _WithoutWorkingDirectory():
            from fedcontrast.openfl.guard import component_refusal
    except Exception as exc:  # fedcontrast half-installed: refuse rather than build unchecked
        _refuse_component(f"the plan component {template!r} cannot be checked ({exc}); reinstall fedcontrast")
    plan = _owner(settings)
    refusal = (plan._fedcontrast_foreign[1] if plan is not None  # its whole plan, refused at parse
               else component_refusal(template))
    if refusal is not None:
        _refuse_component(refusal)


def _check_plan(plan, party, name):
    files = getattr(plan, "_fedcontrast_files", None) or (None, None)
    plan_path = os.path.abspath(str(files[0] or os.path.join("plan", "plan.yaml")))
    data_path = os.path.abspath(str(files[1] or os.path.join("plan", "data.yaml")))
    key = (party, os.getcwd(), plan_path, data_path, name)
    if key in _checked:
        return
    with _WithoutWorkingDirectory():
        _check(party, None, (plan_path, data_path, name, getattr(plan, "config", None)) if party == "collaborator"
               else (plan_path,))
    _checked.add(key)


class _PatchingLoader:
    """OpenFL's own loader of its plan module, which then wraps the Plan class (:func:`_patch_plan`)."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        if hasattr(module, "Plan"):
            _patch_plan(module.Plan)

    def __getattr__(self, name):  # get_code, get_source, … for tracebacks and tools
        return getattr(self.loader, name)


class _OpenFLGuard:
    """First on ``sys.meta_path``: finds nothing itself, but runs the start checks when OpenFL is first
    imported, and hands OpenFL's plan module a loader that wraps its Plan class."""

    def find_spec(self, name, path=None, target=None):
        if _parsed:
            refusal = _foreign_import(name)
            if refusal is not None:
                _refuse_component(refusal)
        if not name.startswith("openfl"):
            return None
        if not _state["argv_checked"]:
            _state["argv_checked"] = True
            _guard()
        if name == PLAN_MODULE:
            from importlib.machinery import PathFinder

            spec = PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)  # type: ignore[assignment]  # a Loader by delegation
            return spec
        return None


def install():
    """Put the watcher first on ``sys.meta_path`` (once); catch up when OpenFL was imported before."""
    if not any(isinstance(f, _OpenFLGuard) for f in sys.meta_path):
        sys.meta_path.insert(0, _OpenFLGuard())
    if not _state["argv_checked"] and "openfl" in sys.modules:
        _state["argv_checked"] = True
        _guard()
    module = sys.modules.get(PLAN_MODULE)
    if module is not None and hasattr(module, "Plan"):
        _patch_plan(module.Plan)


def from_torch():
    """Called by torch at its import (``_fedcontrast_torch_guard``): the watcher, also where site-packages'
    ``.pth`` files were not run (``python -S`` with site-packages on ``PYTHONPATH``)."""
    install()


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


install()
_guard_flower_site()
