"""Command-line options and option tables generated from config dataclasses.

Each option is defined once, as a dataclass field whose ``metadata`` holds its ``help`` and,
where needed:

- ``choices``: the allowed values;
- ``parse``: how the command line's text becomes a value when the field's type does not say
  (``str`` leaves the text to the command's config to read, e.g. ``keep`` with
  :func:`vlm_focus.config.read_keep`; a function, not a type, has its ``ValueError``
  message shown as argparse's);
- ``default_text``: what ``--help`` shows for the default (for a default of ``None`` that stands
  for something, e.g. "the embedded model");
- ``nargs``, ``metavar``: as in argparse; ``append``: the flag may be given several times, its
  values collected in a list; ``cli=False``: not on the command line;
- ``tag``: the letter a run's tag writes before the value when it is away from its default,
  ``recorded="when_set"``: a run's record holds it only then
  (:class:`vlm_focus.setting.RunSetting`).

:func:`add_options` turns the fields into argparse options whose help ends with the default,
and :func:`parse_config` builds the dataclass from what was given, so every default comes from
the dataclass itself. :func:`inherit` copies a field (default and metadata) into another
dataclass, and :func:`inherit_options` every command-line field of one, so a command exposes
e.g. ``FocusConfig``'s options without naming them; :func:`config_of` builds the config back.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

_PARSERS = {"int": int, "float": float, "str": str, "Path": Path}


@dataclasses.dataclass(frozen=True)
class OptionInfo:
    """One option: its name, type (as written in the dataclass), default and help."""

    name: str
    type: str
    default: Any
    help: str

    @property
    def default_text(self) -> str:
        """The default as Python writes it (``'fastv'``, ``True``, ``None``)."""
        return repr(self.default)


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A ``dataclasses.field`` of an option table: its default, its help and any other metadata
    the tables read (``default_text``, ``choices``, ``metavar``, ...)."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def inherit(cls: type, name: str, *, default: Any = dataclasses.MISSING, **metadata: Any) -> Any:
    """A ``dataclasses.field`` with the default and metadata of ``cls``'s field ``name``
    (``default`` and ``metadata`` entries override), for a config that exposes the same
    option."""
    source = _field(cls, name)
    merged = {**source.metadata, **metadata}
    if default is not dataclasses.MISSING:
        return dataclasses.field(default=default, metadata=merged)
    if source.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=source.default_factory, metadata=merged)
    return dataclasses.field(default=source.default, metadata=merged)


def default_of(cls: type, name: str) -> Any:
    """The default of ``cls``'s field ``name``."""
    return _default(_field(cls, name))


def options(cls: type, *, cli_only: bool = False) -> list[OptionInfo]:
    """Every field of the dataclass ``cls`` as an :class:`OptionInfo`, in field order."""
    out = []
    for f in dataclasses.fields(cls):
        if cli_only and not f.metadata.get("cli", True):
            continue
        out.append(OptionInfo(f.name, _type_name(f.type), _default(f), f.metadata.get("help", "")))
    return out


def inherit_options(
    source: type,
    *,
    before: str,
    make_field: Callable[[str], Any] | None = None,
) -> Callable[[type], type]:
    """A class decorator, written under ``@dataclass``: the decorated class gains every
    command-line field of the dataclass ``source`` that it does not define itself, in
    ``source``'s order, placed before its own field ``before``. ``make_field(name)`` makes
    each field (default: :func:`inherit`, ``source``'s default and metadata); a field whose
    default is ``None`` is typed as optional."""

    def add(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        if before not in own:
            raise ValueError(f"{cls.__name__} has no field {before!r} to place options before")
        added = {}
        for f in dataclasses.fields(source):
            if f.name in own or not f.metadata.get("cli", True):
                continue
            made = make_field(f.name) if make_field else inherit(source, f.name)
            type_name = _type_name(f.type)
            if made.default is None and not type_name.endswith("| None"):
                type_name += " | None"
            added[f.name] = type_name
            setattr(cls, f.name, made)
        merged = {}
        for name, annotation in own.items():
            if name == before:
                merged.update(added)
            merged[name] = annotation
        cls.__annotations__ = merged
        return cls

    return add


def check_choices(config: Any, cls: type) -> None:
    """``ValueError`` for a field of the dataclass ``cls`` whose value in ``config`` (an
    instance of ``cls`` or of a subclass, which checks its own fields) is not one of its
    metadata's ``choices``, naming the field, the value and the choices."""
    for f in dataclasses.fields(cls):
        choices = f.metadata.get("choices")
        if choices is not None and getattr(config, f.name) not in choices:
            raise ValueError(f"{f.name}={getattr(config, f.name)!r} is not one of {choices}")


def config_of(cls: type, source: Any, **overrides: Any) -> Any:
    """``cls`` (a config dataclass, e.g. :class:`~vlm_focus.FocusConfig`) built from the
    fields of ``source`` that it has (a command's options that inherit them), with
    ``overrides``."""
    names = [f.name for f in dataclasses.fields(cls) if hasattr(source, f.name)]
    return cls(**{**{n: getattr(source, n) for n in names}, **overrides})


def pruner_option_field() -> Any:
    """The command lines' and the demo's one way to give a pruner its own options
    (``--pruner-option base=text``, repeatable), read by
    :func:`vlm_focus.pruners.read_pruner_options` against the chosen pruner's options."""
    return dataclasses.field(
        default_factory=list,
        metadata={
            "help": "an option of the chosen pruner as NAME=VALUE (e.g. base=text), repeatable; "
            "`vlm-focus pruners` lists each pruner's options",
            "parse": str,
            "append": True,
            "metavar": "NAME=VALUE",
            "default_text": "the pruner's defaults",
        },
    )


def flag(name: str) -> str:
    """``--query-rows`` for ``query_rows``."""
    return "--" + name.replace("_", "-")


def show(value: Any) -> str:
    """A default as ``--help`` and the option tables print it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return ",".join(show(v) for v in value) if value else "none"
    if isinstance(value, dict):
        return "{}" if not value else repr(value)
    if isinstance(value, str):
        return repr(value) if value != value.strip() or not value else value
    return str(value)


def help_text(f: dataclasses.Field) -> str:
    """The help of a field with its default, as ``--help`` prints it."""
    default = f.metadata.get("default_text") or show(_default(f))
    return f"{f.metadata.get('help', '')} (default: {default})"


def add_options(
    parser: argparse.ArgumentParser | Any,
    cls: type,
    *,
    exclude: Iterable[str] = (),
    defaults: bool = False,
) -> None:
    """Add one option per command-line field of ``cls`` to ``parser`` (or an argument group).

    Options that are not given stay out of the parsed namespace, so :func:`parse_config` can
    tell them from the defaults (which come from ``cls``); with ``defaults=True`` the namespace
    holds every option, given or not, at the dataclass's default."""
    skip = set(exclude)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.metadata.get("cli", True):
            continue
        meta = f.metadata
        kwargs: dict[str, Any] = {
            "dest": f.name,
            "default": _default(f) if defaults else argparse.SUPPRESS,
            "help": help_text(f).replace("%", "%%"),
        }
        type_name = _type_name(f.type)
        if type_name == "bool":
            kwargs["action"] = "store_true" if not _default(f) else argparse.BooleanOptionalAction
        else:
            parse = meta.get("parse") or _PARSERS.get(type_name.removesuffix(" | None"))
            if parse is not None and not isinstance(parse, type):
                parse = _argparse_type(parse)
            if parse is None:
                raise TypeError(
                    f"{cls.__name__}.{f.name} ({type_name}) needs metadata 'parse' to be a "
                    "command-line option"
                )
            kwargs.update(type=parse, action=_Append if meta.get("append") else "store")
            for key in ("choices", "nargs", "metavar"):
                if key in meta:
                    kwargs[key] = meta[key]
        parser.add_argument(flag(f.name), **kwargs)


def add_command(
    subparsers: Any, name: str, cls: type, help: str, *, exclude: Iterable[str] = ()
) -> argparse.ArgumentParser:
    """A subcommand ``name`` whose options are ``cls``'s command-line fields (:func:`add_options`)
    and whose description is ``cls``'s docstring; abbreviated flags are refused."""
    command = subparsers.add_parser(name, help=help, description=cls.__doc__, allow_abbrev=False)
    add_options(command, cls, exclude=exclude)
    return command


def given(namespace: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` that the command line gave, with their values."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(namespace).items() if k in names}


def parse_config(cls: type, namespace: argparse.Namespace, **extra: Any) -> Any:
    """``cls`` built from the options given on the command line (and ``extra``); every option
    not given takes the dataclass's default."""
    return cls(**given(namespace, cls), **extra)


def options_markdown(rows: Iterable[tuple[str, OptionInfo]], first: str = "pruner") -> str:
    """A markdown table ``| first | option | type | default | what it does |``."""
    lines = [f"| {first} | option | type | default | what it does |", "|---|---|---|---|---|"]
    for owner, info in rows:
        cells = [f"`{owner}`", f"`{info.name}`", f"`{info.type}`", f"`{info.default_text}`"]
        cells.append(info.help)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _argparse_type(read: Any) -> Any:
    """``read`` as an argparse ``type``: its ``ValueError`` message becomes argparse's (which
    would otherwise print only "invalid value")."""

    def parse(text: str) -> Any:
        try:
            return read(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = read.__name__
    return parse


class _Append(argparse.Action):
    """``append``: a flag given several times collects its values in a list."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        collected = list(getattr(namespace, self.dest, None) or [])
        setattr(namespace, self.dest, [*collected, values])


def _field(cls: type, name: str) -> dataclasses.Field:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise ValueError(f"{cls.__name__} has no option {name!r}")


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    return getattr(annotation, "__name__", str(annotation))
