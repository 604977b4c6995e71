"""Loaded at every interpreter start in an environment where fedcontrast is installed (by the file
``fedcontrast_fx_guard.pth``); does nothing unless this process is ``fx collaborator start``.

Then, before OpenFL puts the workspace first on ``sys.path`` and imports the plan's components, the
workspace and its plan are checked (:func:`fedcontrast.openfl.package_trust.guard_collaborator_start`):
no Python file in the workspace, only installed components, TLS on unless the site's policy allows
otherwise. A refusal is one sentence on standard error and exit code 1.
"""

import os
import sys


def _is_collaborator_start(argv):
    if not argv or os.path.basename(argv[0]) != "fx":
        return False
    args = argv[1:]
    return "collaborator" in args and args[args.index("collaborator") + 1:args.index("collaborator") + 2] == ["start"]


def _guard():
    argv = list(getattr(sys, "argv", None) or [])
    if not _is_collaborator_start(argv):
        return
    try:
        from fedcontrast.errors import FedContrastError
        from fedcontrast.openfl.package_trust import guard_collaborator_start
    except Exception as exc:  # fedcontrast half-installed: refuse rather than run unchecked
        sys.stderr.write(f"fedcontrast collaborator: error: the workspace cannot be checked ({exc}); reinstall "
                         "fedcontrast\n")
        sys.stderr.flush()
        os._exit(1)
    try:
        guard_collaborator_start(argv, os.getcwd())
    except FedContrastError as exc:
        sys.stderr.write(f"fedcontrast collaborator: error: {exc}\n")
        sys.stderr.flush()
        os._exit(1)
    except Exception as exc:
        sys.stderr.write(f"fedcontrast collaborator: error: the workspace could not be checked ({type(exc).__name__}: "
                         f"{exc}); nothing was run\n")
        sys.stderr.flush()
        os._exit(1)


_guard()
