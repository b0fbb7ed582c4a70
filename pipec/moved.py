"""Old import paths that still work: the one table of what moved, and the import hook that serves it.

A path that a README, a docs page or an example once showed is a promise, even after the module behind it
moved (the house step of 0.1 renamed more than a hundred modules without a word). Every such path keeps
working for at least one minor version after the move, warning with a `DeprecationWarning` that names the
new path, and is listed in CHANGELOG.md. The table below is the only place that says where a thing went:
the hook, the tests (`tests/unit/surface/test_deprecated_paths.py` runs every row) and CHANGELOG.md's list
all read it.

Two kinds of row:
- `MODULES`: an old module path -> the modules that now hold its names, tried in order. With one home the
  old path *is* the new module (`import` returns the same object); with several, the old path is a small
  module whose names resolve in the homes, each warning with its own new path. `python -m OLD` runs the new
  module as `__main__` (torchrun's `python -m pipec.runtime.launch` keeps working).
- `NAMES`: a module that still exists but lost a name -> where the name went.

The hook is a `sys.meta_path` finder installed by `import pipec`: a dictionary look-up for every import, so
it costs nothing to the imports it does not serve. It imports no pipec module of its own; a home is
imported only when an old path is used.
"""

from __future__ import annotations

import sys
import warnings
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType

SINCE = "0.2.0"  # the release that added these aliases
UNTIL = "0.3.0"  # the first release that may drop them

_CSV = ("pipec.formats.torch_csv_reader", "pipec.formats.torch_csv_writer")

MODULES: dict[str, tuple[str, ...]] = {
    # the two entry points that broke a user's script (issue 41)
    "pipec.runtime.launch": ("pipec.runtime.job.launch",),
    "pipec.runtime.split_model": ("pipec.runtime.model.split",),
    # the compiler's modules before the floors (README and docs of November 2026)
    "pipec.compiler": ("pipec.passes.compiler",),
    "pipec.costs": ("pipec.sim.costs", "pipec.sim.cost_files", "pipec.ir.units"),
    "pipec.dryrun": ("pipec.passes.dryrun",),
    "pipec.library": ("pipec.frontend.library",),
    "pipec.lower": ("pipec.passes.lower",),
    "pipec.memory": ("pipec.sim.memory",),
    "pipec.passes.memory": ("pipec.sim.memory",),
    "pipec.policy": ("pipec.passes.policy",),
    "pipec.program": ("pipec.ir.program", "pipec.formats.program_file", "pipec.ir.validate"),
    "pipec.schedule": ("pipec.ir.schedule",),
    "pipec.simulate": ("pipec.sim.simulate",),  # also the facade's function: see _Guarded
    "pipec.timeline": ("pipec.sim.timeline",),
    "pipec.trace": ("pipec.formats.trace",),
    "pipec.sim.trace": ("pipec.formats.trace",),
    "pipec.render": ("pipec.view.render",),
    "pipec.sim.render": ("pipec.view.render",),
    "pipec.report": ("pipec.view.report",),
    "pipec.sim.report": ("pipec.view.report",),
    "pipec.sim.grid": ("pipec.view.grid",),
    "pipec.torch_csv": _CSV,
    "pipec.interop.torch_csv": _CSV,
    "pipec.formats.torch_csv": _CSV,
    "pipec.interop.pipe_text": ("pipec.formats.pipe_text",),
    "pipec.partition.files": ("pipec.formats.partition_files",),
    # the runtime's modules before its rooms
    "pipec.runtime.affinity": ("pipec.runtime.host.affinity",),
    "pipec.runtime.job.affinity": ("pipec.runtime.host.affinity",),
    "pipec.runtime.slices": ("pipec.runtime.exec.slices",),
    "pipec.runtime.microbatch": ("pipec.runtime.exec.microbatch",),
    "pipec.runtime.partitioned": ("pipec.runtime.model.partitioned",),
    "pipec.runtime.layer_profile": ("pipec.runtime.profile.layers",),
}

NAMES: dict[str, dict[str, str]] = {
    "pipec.api": {"build": "pipec.driver"},
    "pipec.ir.program": {
        "from_json": "pipec.formats.program_file",
        "from_text": "pipec.formats.program_file",
        "to_json": "pipec.formats.program_file",
        "to_text": "pipec.formats.program_file",
        "validate": "pipec.ir.validate",
    },
    "pipec.sim.costs": {
        "dump_costs": "pipec.sim.cost_files",
        "normalize": "pipec.sim.cost_files",
        "parse_overrides": "pipec.sim.cost_files",
        "read_cost_file": "pipec.sim.cost_files",
        "quantity": "pipec.ir.units",
    },
    "pipec.partition": {"Problem": "pipec.partition.problem"},
    "pipec.view.grid": {"unit_json": "pipec.ir.schedule"},
    "pipec.partition.search": {"step_lp": "pipec.partition.bounds"},
    "pipec.runtime.profile": {"profile": "pipec.runtime.profile.stages", "stage_bytes": "pipec.runtime.profile.held"},
    "pipec.runtime.profile.insitu": {"deliveries": "pipec.runtime.profile.overhead"},
}

# Packages that exist only as the parents of old paths (`pipec.interop.torch_csv`).
_PARENTS = frozenset({"pipec.interop"})


def warn(old: str, new: str) -> None:
    """One DeprecationWarning, attributed to the user's line: the first frame outside this file.

    `warnings` itself steps over the import machinery's frames when it counts `stacklevel`, so only this
    file's frames are counted here.
    """
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        internal = "importlib" in name and "_bootstrap" in name
        level += not internal
        if name != __file__ and not internal:
            break
        frame = frame.f_back
    warnings.warn(
        f"{old} is deprecated since pipec {SINCE} and goes in {UNTIL}: use {new}",
        DeprecationWarning,
        stacklevel=level,
    )


def _resolve(old: str, name: str, homes: tuple[str, ...]) -> object:
    """`name` from the first home that defines it, with the warning naming that home.

    The value is then kept on the old module, so a name warns once (`from X import a` looks `a` up twice).
    """
    import importlib

    for home in homes:
        module = importlib.import_module(home)
        if name in module.__dict__:
            warn(f"{old}.{name}", f"{home}.{name}")
            value = module.__dict__[name]
            sys.modules[old].__dict__[name] = value
            return value
    raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved: see pipec.moved)")


def _names_getattr(module: ModuleType, moved: dict[str, str]):
    """A module `__getattr__` (PEP 562) for names that left `module`, chained to one it already had."""
    before = module.__dict__.get("__getattr__")

    def __getattr__(name: str) -> object:
        if name in moved:
            return _resolve(module.__name__, name, (moved[name],))
        if before is not None:
            return before(name)
        raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

    return __getattr__


class _Guarded(ModuleType):
    """A package whose facade has a name that is also an old submodule path (`pipec.simulate`, the function,
    and `pipec.simulate`, the module of 0.1; `pipec.runtime.split_model` likewise). Importing the old path
    must not replace the facade's name with the module, as the import machinery would (it sets each loaded
    module on its parent), so that attribute is left as it is: `from OLD import x` still works, since it reads
    the module from sys.modules."""

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, ModuleType) and f"{self.__name__}.{name}" in MODULES:
            return
        super().__setattr__(name, value)


def _guard_parent(old: str) -> None:
    """Guard `old`'s parent (above) when the parent's facade already answers `old`'s last name."""
    parent_name, _, leaf = old.rpartition(".")
    parent = sys.modules.get(parent_name)
    if parent is None or type(parent) is not ModuleType or not hasattr(parent, "__all__") or leaf not in parent.__all__:
        return
    parent.__class__ = _Guarded


class _Alias:
    """The loader of an old path: the new module itself (one home), or a module resolving in its homes."""

    def __init__(self, old: str, homes: tuple[str, ...]) -> None:
        self.old, self.homes = old, homes

    def create_module(self, spec: ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        if self.old in _PARENTS:
            module.__path__ = []
            module.__doc__ = f"A parent of old pipec paths ({SINCE}): see pipec.moved."
            return
        _guard_parent(self.old)
        if len(self.homes) == 1:
            import importlib

            warn(self.old, self.homes[0])
            # A module may replace itself in sys.modules; the import then returns the replacement.
            sys.modules[self.old] = importlib.import_module(self.homes[0])
            return
        module.__doc__ = f"{self.old} moved ({SINCE}): its names are now in {', '.join(self.homes)}."
        old, homes = self.old, self.homes
        module.__getattr__ = lambda name: _resolve(old, name, homes)

    def get_code(self, name: str):
        """For `python -m OLD`: warn, then run the new module as `__main__` with the same argv."""
        new = self.homes[0]
        source = (
            "import sys, runpy\n"
            f"from pipec.moved import warn\nwarn({('python -m ' + self.old)!r}, {('python -m ' + new)!r})\n"
            f"runpy.run_module({new!r}, run_name='__main__', alter_sys=True)\n"
        )
        return compile(source, f"<pipec.moved: {self.old}>", "exec")

    def is_package(self, name: str) -> bool:
        return name in _PARENTS


class _NamesLoader:
    """The real loader of a module that lost names, which then gets the `__getattr__` serving them."""

    def __init__(self, loader, moved: dict[str, str]) -> None:
        self._loader, self._moved = loader, moved

    def create_module(self, spec: ModuleSpec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        module.__getattr__ = _names_getattr(module, self._moved)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


class Finder:
    """The `sys.meta_path` entry: serves the table's old paths, and nothing else."""

    @staticmethod
    def find_spec(name: str, path=None, target=None) -> ModuleSpec | None:
        if name in MODULES or name in _PARENTS:
            return ModuleSpec(name, _Alias(name, MODULES.get(name, ())), is_package=name in _PARENTS)
        moved = NAMES.get(name)
        if moved is None:
            return None
        spec = PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _NamesLoader(spec.loader, moved)
        return spec


def install() -> None:
    """Put the finder first on `sys.meta_path`, once (`import pipec` calls it before any other pipec module)."""
    if not any(isinstance(f, Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, Finder())
