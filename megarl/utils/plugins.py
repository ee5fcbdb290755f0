"""What a config names by import path (a user's workflow, reward or loss): found, imported and checked.

A plug-in value is ``package.module.name`` or ``path/to/file.py:name``. One resolver serves
every plug-in key (``reward_fn``, ``workflow.type`` and its ``kwargs.reward_fn``,
``eval_workflow``, ``actor.loss``) and :func:`megarl.workflow.resolve.resolve_workflow`:

* ``package.module.name``: an installed (importable) package first; else the file
  ``package/module.py`` in the folder of the config file that set the key, then in the
  working directory.
* ``path/to/file.py:name``: the file relative to the config file's folder, then to the
  working directory (an absolute path as is), imported as a module.
* ``__main__.name``: the running script (``python my_script.py`` that loads the config or
  launches the run from Python): it becomes the script's ``/abs/my_script.py:name``, so the
  trainer ranks, where ``__main__`` is another program, import the same definition from the file.

When the config loads (:func:`locate_plugin`, from ``resolve_locations``), a value found in
a folder becomes the file's absolute ``/abs/path/file.py:name``: the saved config the
trainer reads holds it, so the processes ``megarl run`` starts find the same file whatever
their working directory. The file's folder (or its package root) is appended to
``sys.path`` when imported, so spawned reward workers unpickle its functions by name.

Every plug-in is imported and its call signature checked (:func:`signature_problem`) when
the config is checked, before anything is launched: a typo or a wrong signature fails in
seconds with the key named, not after the servers came up.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.machinery
import inspect
import os
import re
import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from megarl.utils.errors import ConfigError

_NAME = r"[A-Za-z_]\w*"
_DOTTED = re.compile(rf"{_NAME}(?:\.{_NAME})+")
_FILE_FORM = re.compile(rf"(?P<file>.+\.py):(?P<name>{_NAME})")
FORMS = "'package.module.name' or 'path/to/file.py:name'"
_MAIN = "__main__"
"""The two spellings of a plug-in, for messages."""


def is_plugin_path(value: str) -> bool:
    """Whether ``value`` is spelled as a plug-in path (else it may be a built-in's short name)."""
    return bool(_DOTTED.fullmatch(value) or _FILE_FORM.fullmatch(value))


def builtin_or_plugin_problem(value: str, builtins: Collection[str], what: str, forms: str = FORMS) -> str | None:
    """Why ``value`` is neither one of the built-in ``what`` names ``builtins`` nor spelled as a plug-in
    (the built-ins listed, the closest suggested), else None."""
    if value in builtins or is_plugin_path(value):
        return None
    close = difflib.get_close_matches(value, list(builtins), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"neither a built-in {what} {sorted(builtins)}{hint} nor {forms}"


def locate_plugin(path: str, key: str, folders: Sequence[str | os.PathLike] = ()) -> str:
    """``path`` as every process of the run resolves it alike: unchanged when an installed
    package holds it, else the absolute ``/abs/file.py:name`` of the file it names.

    ``folders``: where the config file that set ``key`` lies; the working directory is
    searched after them. A value that is no plug-in path (a built-in's short name) comes back
    unchanged, for its key's own check. A :class:`ConfigError` naming ``key``, the value and
    each place searched when nothing is found.
    """
    if path.startswith(f"{_MAIN}."):
        return _in_running_script(path, key)
    places = _search_folders(folders)
    form = _FILE_FORM.fullmatch(path)
    if form is not None:
        given = Path(form["file"]).expanduser()
        candidates = [given] if given.is_absolute() else [folder / given for folder in places]
        return _first_file(path, key, candidates, form["name"], [])
    if not _DOTTED.fullmatch(path):
        return path
    module, _, name = path.rpartition(".")
    if _installed(module.partition(".")[0], places):
        return path
    relative = Path(*module.split("."))
    candidates = [
        c for folder in places for c in (folder / relative.with_suffix(".py"), folder / relative / "__init__.py")
    ]
    return _first_file(path, key, candidates, name, ["the installed packages"], module)


def _in_running_script(path: str, key: str) -> str:
    """``__main__.name`` as ``/abs/script.py:name``: the script this process runs, which defines ``name``."""
    name = path[len(_MAIN) + 1 :]
    main = sys.modules.get(_MAIN)
    script = getattr(main, "__file__", None)
    if script is None:
        raise ConfigError(
            key,
            f"{path!r}: '__main__' is the running script, but this program runs none (an interactive "
            f"session or python -c): put {name.partition('.')[0]} in a file and name it 'file.py:{name}'",
        )
    script = Path(script).resolve()
    if "." in name or not hasattr(main, name):
        raise ConfigError(
            key,
            f"{path!r}: the running script {script} defines no {name!r} (at its top level, before it "
            "loads the config); '__main__.name' names your own script that starts megarl from Python",
        )
    return f"{script}:{name}"


def _first_file(path: str, key: str, candidates: list[Path], name: str, searched: list[str], module: str = "") -> str:
    for candidate in candidates:
        if candidate.is_file():
            return f"{candidate.resolve()}:{name}"
    what = f"cannot import module {module!r}" if module else "no such file"
    places = ", ".join([*searched, *(str(c) for c in candidates)])
    raise ConfigError(key, f"{path!r}: {what}; searched {places}")


def _search_folders(folders: Sequence[str | os.PathLike]) -> list[Path]:
    """``folders`` then the working directory, absolute, each once."""
    out: list[Path] = []
    for folder in [*folders, Path.cwd()]:
        folder = Path(folder).expanduser().resolve()
        if folder not in out:
            out.append(folder)
    return out


def _installed(top: str, folders: list[Path]) -> bool:
    """Whether the top-level module ``top`` imports without ``folders`` on ``sys.path``.

    The working directory is on ``sys.path`` under ``python -m`` and the ``megarl`` command,
    not in a spawned process started elsewhere: a module found only there is a user's file.
    """
    module = sys.modules.get(top)
    if module is not None and getattr(module, "__file__", None) is None and not getattr(module, "__path__", None):
        return True  # built in, or made in memory (a test's stand-in)
    entries = [entry for entry in sys.path if entry not in ("", ".") and Path(entry).resolve() not in folders]
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            spec = finder.find_spec(top, entries)
        else:  # builtins, frozen modules, editable installs' finders
            try:
                spec = finder.find_spec(top, None)
            except Exception:  # noqa: BLE001 -- a third-party finder that cannot answer does not hold it
                spec = None
        if spec is not None:
            return True
    return False


def import_plugin(path: str, key: str, folders: Sequence[str | os.PathLike] = ()) -> Any:
    """The object ``path`` names (either spelling, see :func:`locate_plugin`); a :class:`ConfigError`
    naming ``key`` otherwise."""
    if not is_plugin_path(path):
        raise ConfigError(key, f"{path!r} is not of the form {FORMS}")
    located = locate_plugin(path, key, folders)
    form = _FILE_FORM.fullmatch(located)
    if form is not None:
        module, name = _import_file(Path(form["file"]), path, key), form["name"]
    else:
        module_name, _, name = located.rpartition(".")
        module = _import_module(module_name, path, key)
    try:
        return getattr(module, name)
    except AttributeError:
        raise ConfigError(key, f"{path!r}: module {module.__name__!r} has no attribute {name!r}") from None


def _import_module(module_name: str, path: str, key: str):
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(key, f"{path!r}: cannot import module {module_name!r}: {err}") from None
    except SystemExit as err:  # the user's module called sys.exit: megarl would stop without a word
        raise ConfigError(key, f"{path!r}: importing {module_name!r} called sys.exit({err.code!r})") from None
    except Exception as err:  # noqa: BLE001 -- the user's module itself raised while importing
        raise ConfigError(key, f"{path!r}: importing {module_name!r} raised {type(err).__name__}: {err}") from None


def _import_file(file: Path, path: str, key: str):
    """The module of ``file``, imported by its name under its package root (appended to ``sys.path``).

    By name rather than from the file alone, so that pickling its functions by reference
    works in spawned workers, which inherit ``sys.path``. The script this process runs is its
    ``__main__`` module, not run a second time.
    """
    main = sys.modules.get(_MAIN)
    if getattr(main, "__file__", None) is not None and Path(main.__file__).resolve() == file.resolve():
        return main
    root, parts = file.parent, [file.stem] if file.name != "__init__.py" else []
    while (root / "__init__.py").is_file():
        parts.insert(0, root.name)
        root = root.parent
    name = ".".join(parts)
    if str(root) not in sys.path:
        sys.path.append(str(root))
        importlib.invalidate_caches()
    module = _import_module(name, path, key)
    found = getattr(module, "__file__", None)
    if found is None or Path(found).resolve() != file:
        raise ConfigError(
            key, f"{path!r}: {file} imports as module {name!r}, which is {found or 'a built-in'}: rename the file"
        )
    return module


def signature_problem(fn: Any, args: tuple = (), kwargs: dict | None = None, partial: bool = False) -> str | None:
    """Why calling ``fn(*args, **kwargs)`` would fail on the signature alone, else None.

    ``partial``: more arguments come at call time (a reward's dataset fields), so only
    those given are checked.
    """
    if not callable(fn):
        return f"{fn!r} is not callable"
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no introspectable signature (a C function): trust it
        return None
    try:
        (signature.bind_partial if partial else signature.bind)(*args, **(kwargs or {}))
    except TypeError as err:
        return f"{getattr(fn, '__qualname__', fn)}{signature} cannot be called that way: {err}"
    return None


def accepted_parameters(fn: Any) -> set[str] | None:
    """Names ``fn`` takes as keywords; None when it takes any (``**kwargs``)."""
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters if p.kind in keyword}
