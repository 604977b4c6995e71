"""Installs, besides the package, ``fedcontrast_fx_guard.pth``: at every interpreter start it loads
``_fedcontrast_fx_guard`` (``src/_fedcontrast_fx_guard.py``; named for ``fx``, it guards Flower too),
which checks a site's workspace before OpenFL starts a collaborator or an aggregator from it (whatever
the launcher) and keeps the operator's app bundle's code out of a Flower site's ClientApp; and
``_fedcontrast_torch_guard.py``, which torch runs at its import (entry point group ``torch.backends``,
in pyproject.toml), so that the same guard is installed where ``.pth`` files are not run (``python -S``
with site-packages on ``PYTHONPATH``). Both lie in site-packages itself, for editable installs too
(whose package may then not be importable: the stub then does nothing). Everything else is in
pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

GUARD_PTH_NAME = "fedcontrast_fx_guard.pth"
GUARD_PTH_TEXT = b"import _fedcontrast_fx_guard\n"  # one line: site-packages runs it at interpreter start
TORCH_GUARD_NAME = "_fedcontrast_torch_guard.py"
TORCH_GUARD_TEXT = b'''"""Run by torch at its import (entry point group torch.backends): installs fedcontrast's start-up
guard where site-packages' .pth files were not run (python -S). Written by fedcontrast's setup.py."""


def load():
    try:
        import _fedcontrast_fx_guard
    except ImportError:  # fedcontrast is not importable in this interpreter (an editable install under -S)
        return
    _fedcontrast_fx_guard.from_torch()
'''


class BuildPyWithGuard(build_py):
    """A wheel's top level gets the ``.pth`` file (site-packages runs it at start-up)."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / GUARD_PTH_NAME
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(GUARD_PTH_TEXT)
        (Path(self.build_lib) / TORCH_GUARD_NAME).write_bytes(TORCH_GUARD_TEXT)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / GUARD_PTH_NAME),
                str(Path(self.build_lib) / TORCH_GUARD_NAME)]


cmdclass = {"build_py": BuildPyWithGuard}

try:  # an editable install (pip install -e .) is a wheel of path hooks: add the guard's .pth beside them
    from setuptools.command.editable_wheel import editable_wheel

    class EditableWheelWithGuard(editable_wheel):
        def _select_strategy(self, *args, **kwargs):
            strategy = super()._select_strategy(*args, **kwargs)
            original = strategy.__call__

            class WithGuard(type(strategy)):
                def __call__(self, wheel, files, mapping):
                    original(wheel, files, mapping)
                    wheel.writestr(GUARD_PTH_NAME, GUARD_PTH_TEXT)
                    wheel.writestr(TORCH_GUARD_NAME, TORCH_GUARD_TEXT)

            strategy.__class__ = WithGuard
            return strategy

    cmdclass["editable_wheel"] = EditableWheelWithGuard
except ImportError:  # an old setuptools without PEP 660 editable wheels
    pass

setup(cmdclass=cmdclass)
