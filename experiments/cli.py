"""Command-line pieces the experiment programs share.

Flag checks that stop a bad value at parse time by name (`require_ints`, `refuse_flags_of`), and
the checked ``ml_collections`` config of an absl program: `define_config` declares it, a table of
`Field` s beside the config (``FIELDS`` in ``configs/*.py``) says what each field means and which
values it takes, and `run` starts the program so that

* ``--help`` lists every field with its default, its meaning and the values it takes;
* every field is checked before ``main`` runs, so before any model is loaded or any turn served;
* a bad value stops the program with one line (no traceback) that names ``--config.FIELD``
  (nested: ``--config.PARENT.FIELD``) and what the field takes.
"""

from __future__ import annotations

import dataclasses
import difflib
import pathlib
import sys
import textwrap
from typing import Any, Callable, Mapping

from absl import app, flags


def require_ints(name: str, lo: int, hi: int | None = None, what: str = "") -> None:
    """Register a check that every entry of list flag ``name`` is an integer in ``lo..hi``."""
    def ok(values) -> bool:
        try:
            return all(lo <= int(v) and (hi is None or int(v) <= hi) for v in values or ())
        except ValueError:
            return False

    bounds = f"{lo}..{hi}" if hi is not None else f">= {lo}"
    flags.register_validator(name, ok, f"--{name}: integers {bounds}{f' ({what})' if what else ''}")


def refuse_flags_of(module: str, used: set[str]) -> None:
    """Stop on any flag ``module`` defines that this script was given but does not read.

    Scripts that import another's helpers inherit all of its flags; without this,
    ``count_kernels.py --tp 2`` would parse and count one device's kernels.
    """
    ignored = sorted(f.name for f in flags.FLAGS.get_flags_for_module(module)
                     if f.present and f.name not in used)
    if ignored:
        raise app.UsageError(f"{', '.join('--' + n for n in ignored)}: {module}'s flag(s), which this "
                             f"script does not use (it reads {', '.join('--' + n for n in sorted(used))})")


# ============================================================ what a config field takes
@dataclasses.dataclass(frozen=True)
class Values:
    """The values a config field takes: ``accepts`` says which in words (for ``--help`` and errors);
    ``problem(value)`` is None for a value it takes, else what is wrong ('' when ``accepts`` says it)."""

    accepts: str
    problem: Callable[[Any], str | None]


def kind_of(v) -> str:
    """``v``'s type with its article: what a value of the wrong type is said to be."""
    name = type(v).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # True is no count (a typo, not 1)


def one_of(*choices) -> Values:
    return Values("one of " + ", ".join(map(repr, choices)),
                  lambda v: None if any(type(v) is type(c) and v == c for c in choices) else "")


def parsed_by(parse: Callable[[Any], Any], choices) -> Values:
    """What ``parse`` takes without a ValueError (a library's own normaliser, aliases included),
    described as ``choices``."""
    def problem(v):
        try:
            parse(v)
        except (ValueError, TypeError):
            return ""
        return None

    return Values("one of " + ", ".join(map(repr, choices)), problem)


def integer(lo: int | None = None, hi: int | None = None, also: Mapping[int, str] | None = None) -> Values:
    """An int in ``lo..hi`` (either end open when None), or one of ``also`` (value -> its meaning)."""
    also = dict(also or {})
    bounds = (f"in {lo}..{hi}" if lo is not None and hi is not None else f">= {lo}" if lo is not None
              else f"<= {hi}" if hi is not None else "")
    words = f"an integer {bounds}".strip() + "".join(f", or {k} ({m})" for k, m in also.items())

    def problem(v):
        if not _is_int(v):
            return kind_of(v)
        if v in also or ((lo is None or v >= lo) and (hi is None or v <= hi)):
            return None
        return ""

    return Values(words, problem)


def number(lo: float | None = None, hi: float | None = None, hi_open: bool = False) -> Values:
    """A float or int in ``[lo, hi]`` (``[lo, hi)`` with ``hi_open``)."""
    close = ")" if hi_open else "]"
    words = ("a number" + (f" in [{lo}, {hi}{close}" if lo is not None and hi is not None
                           else f" >= {lo}" if lo is not None else f" <= {hi}" if hi is not None else ""))

    def problem(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return kind_of(v)
        above = lo is None or v >= lo
        below = hi is None or (v < hi if hi_open else v <= hi)
        return None if above and below else ""

    return Values(words, problem)


BOOLEAN = Values("True or False", lambda v: None if isinstance(v, bool) else kind_of(v))
OUTPUT_PATH = Values("a non-empty path", lambda v: None if isinstance(v, str) and v else "")


def optional(values: Values, none_means: str) -> Values:
    """``values`` or None, which means ``none_means``."""
    return Values(f"{values.accepts}, or None ({none_means})", lambda v: None if v is None else values.problem(v))


def tuple_of(values: Values, empty_means: str) -> Values:
    """A tuple (or list) whose every element ``values`` takes; ``()`` means ``empty_means``."""
    def problem(v):
        if not isinstance(v, (tuple, list)):
            return kind_of(v)
        for x in v:
            p = values.problem(x)
            if p is not None:
                return f"element {x!r} is {p or 'refused'}"
        return None

    return Values(f"a tuple of {values.accepts}; () {empty_means}", problem)


def existing_path(kind: str, holding: tuple[str, ...] = (), root: pathlib.Path | None = None) -> Values:
    """An existing ``"file"`` or ``"dir"`` (holding the files ``holding``); a relative path is read
    against ``root`` (None: the working directory), as the program reads it."""
    noun = {"file": "file", "dir": "directory"}[kind]
    words = f"an existing {noun}" + (f" holding {', '.join(holding)}" if holding else "") + (
        f" (relative paths from {root})" if root else "")

    def problem(v):
        if not isinstance(v, str) or not v:
            return kind_of(v) if not isinstance(v, str) else "empty"
        p = pathlib.Path(v)
        p = p if p.is_absolute() or root is None else root / p
        if not (p.is_file() if kind == "file" else p.is_dir()):
            return f"no such {noun}"
        missing = [h for h in holding if not (p / h).exists()]
        return f"it has no {', '.join(missing)}" if missing else None

    return Values(words, problem)


@dataclasses.dataclass(frozen=True)
class Field:
    """One config field a program reads: what it means (``--help``) and the values it takes.

    A table key ``"PARENT.*"`` describes every entry of the dict field ``PARENT``, whatever its
    name (the ablation's variants). ``required=False``: a config may leave the field out.
    """

    help: str
    values: Values | None = None  # None: any value
    required: bool = True


# ============================================================ checking a config against its table
def _fields_of(config, fields: Mapping[str, Field], prefix: str = ""):
    """``(dotted name, value)`` of every leaf of ``config``: a dict is a leaf where the table
    describes it whole, its entries are where the table has ``NAME.*``, else it is walked."""
    for key in config.keys():
        name, value = prefix + key, config[key]
        if hasattr(value, "keys") and name not in fields:
            if f"{name}.*" in fields:
                yield from ((f"{name}.{k}", value[k]) for k in value.keys())
            else:
                yield from _fields_of(value, fields, name + ".")
        else:
            yield name, value


def _spec(fields: Mapping[str, Field], name: str) -> Field | None:
    parent = name.rpartition(".")[0]
    return fields.get(name) or (fields.get(parent + ".*") if parent else None)


def _siblings(fields: Mapping[str, Field], name: str) -> list[str]:
    parent = name.rpartition(".")[0]
    return [n.rpartition(".")[2] for n in fields if n.rpartition(".")[0] == parent and not n.endswith(".*")]


def check_config(config, fields: Mapping[str, Field], flag: str = "config") -> None:
    """Raise `app.UsageError` for the first field of ``config`` that ``fields`` does not know, takes
    no value of, or misses, naming ``--config.NAME`` and what the field takes."""
    given = dict(_fields_of(config, fields))
    for name, value in given.items():
        spec = _spec(fields, name)
        if spec is None:
            known = _siblings(fields, name)
            close = difflib.get_close_matches(name.rpartition(".")[2], known, n=1)
            where = f"--{flag}.{name.rpartition('.')[0]}" if "." in name else f"--{flag}"
            raise app.UsageError(f"--{flag}.{name}: no such field{f' (did you mean {close[0]}?)' if close else ''}; "
                                 f"{where} has {', '.join(known)}")
        problem = spec.values.problem(value) if spec.values else None
        if problem is not None:
            raise app.UsageError(f"--{flag}.{name}={value!r}: {f'{problem}; ' if problem else ''}"
                                 f"give {spec.values.accepts}")
    for name, spec in fields.items():
        if spec.required and not name.endswith(".*") and name not in given:
            raise app.UsageError(f"--{flag}.{name}: missing from the config ({spec.help})")


def fields_help(defaults, fields: Mapping[str, Field], flag: str = "config", width: int = 100) -> str:
    """The ``--help`` text of a config: every field of ``fields``, with its default in ``defaults``,
    its meaning and the values it takes."""
    given = dict(_fields_of(defaults, fields))
    lines = [f"\nConfig fields (override one with --{flag}.NAME=VALUE; shown with their defaults):\n"]
    for name, spec in fields.items():
        shown = f"--{flag}.{name.replace('*', 'NAME')}"
        if name in given:
            shown += f"={given[name]!r}"
        elif name.endswith(".*"):
            entries = {k.rpartition(".")[2]: v for k, v in given.items() if k.startswith(name[:-1])}
            shown += f"  (default entries: {', '.join(f'{k}={v!r}' for k, v in entries.items())})"
        text = spec.help + (f" Takes {spec.values.accepts}." if spec.values else "")
        lines.append(textwrap.fill(shown, width, initial_indent="  ", subsequent_indent="      "))
        lines.append(textwrap.fill(text, width, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines).replace("%", "%%") + "\n"


# ============================================================ the program around it
def _program() -> str:
    return pathlib.Path(sys.argv[0]).stem


def _fail(message: str):
    """Stop with one line on stderr (exit status 2, a usage error), no traceback."""
    sys.stderr.write(f"{_program()}: {' '.join(str(message).split())}\n")
    sys.exit(2)


def define_config(default: str, help: str, flag: str = "config"):
    """``config_flags.DEFINE_config_file`` whose failures are one line each.

    The config file is loaded, and its ``--config.NAME=VALUE`` overrides applied, when the flag is
    defined (at import), so a missing config file or an override of a field the config does not
    have stops the program there. ``--help`` lists the flag as the calling program's own.
    """
    from ml_collections import config_flags

    caller = sys._getframe(1).f_globals["__name__"]
    try:
        holder = config_flags.DEFINE_config_file(flag, default, help)
    except (AttributeError, KeyError, ValueError, TypeError, OSError) as e:
        _fail(_override_error(flag, default, e))
    flags.FLAGS.register_key_flag_for_module(sys.argv[0] if caller == "__main__" else caller, flags.FLAGS[flag])
    return holder


def _override_error(flag: str, default: str, error: Exception) -> str:
    """What a failed config flag definition says: the override naming a field the config lacks (with
    the fields it has), else the config file and the error."""
    import importlib.util

    args = sys.argv[1:]
    given = [a[2:].partition("=")[0] for a in args if a.startswith(f"--{flag}.")]
    path = next((a.partition("=")[2] if "=" in a else (args[i + 1] if i + 1 < len(args) else default)
                 for i, a in enumerate(args) if a == f"--{flag}" or a.startswith(f"--{flag}=")), default)
    path = path.partition(":")[0]  # config_flags' "file.py:argument"
    try:
        spec = importlib.util.spec_from_file_location("_config_of_the_failed_flag", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        config = module.get_config()
    except Exception:  # the config file itself is what failed
        return f"--{flag}={path}: {' '.join(str(error).split())}"
    for name in given:
        node, parts = config, name.split(".")[1:]
        for depth, part in enumerate(parts):
            if not hasattr(node, "keys") or part not in node.keys():
                where = ".".join([flag, *parts[:depth]])
                known = list(node.keys()) if hasattr(node, "keys") else []
                close = difflib.get_close_matches(part, known, n=1)
                return (f"--{where}.{part}: no such field{f' (did you mean {close[0]}?)' if close else ''}; "
                        f"--{where} " + (f"has {', '.join(known)}" if known else "is no group of fields"))
            node = node[part]
    return f"{' '.join('--' + n for n in given) or f'--{flag}={path}'}: {' '.join(str(error).split())}"


def _flags_parser(config_flag: str):
    """absl's flag parsing with its errors on one line, an override of a field the config lacks
    among them (``config_flags`` finds some of those only here)."""
    def parse(argv):
        try:
            return flags.FLAGS(argv)
        except flags.Error as e:
            _fail(f"{e} (--help lists the flags and config fields)")
        except (AttributeError, KeyError) as e:
            _fail(_override_error(config_flag, flags.FLAGS[config_flag].default_as_str.strip("'"), e))

    return parse


def run(main: Callable, config, config_module, errors: tuple[type[Exception], ...] = ()) -> None:
    """``absl.app.run(main)`` for a program configured by the flag ``config`` (`define_config`).

    ``config_module`` is the config's module in ``configs/``: ``--help`` lists its ``FIELDS`` with
    the defaults of its ``get_config()``, and the config given is checked against ``FIELDS``
    before ``main`` runs. A usage error (`app.UsageError`, or one of ``errors``: a library's own
    input errors) raised by the check or by ``main`` stops the program with one line.
    """
    fields = config_module.FIELDS
    main_module = sys.modules["__main__"]
    main_module.__doc__ = (main_module.__doc__ or "") + fields_help(config_module.get_config(), fields, config.name)

    def checked_main(argv):
        given = config.value
        try:
            given.keys()
        except OSError as e:  # config_flags defers a config file it could not load to its first use
            _fail(f"--{config.name}: {str(e).strip().splitlines()[-1].strip()}")
        try:
            check_config(given, fields, config.name)
            return main(argv)
        except (app.UsageError, *errors) as e:
            _fail(e)

    app.run(checked_main, flags_parser=_flags_parser(config.name))


def wrote(directory, files, note: str = "") -> None:
    """The last line of a program's output: the directory it wrote to and its main files."""
    print(f"wrote {pathlib.Path(directory).resolve()}/: {', '.join(files)}{f' ({note})' if note else ''}")
