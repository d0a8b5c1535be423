"""Typed dataclass fields that double as command-line options.

A field declared with :func:`option` carries its help text and allowed choices. The same field
then builds the app's ``argparse`` parser (:func:`build_parser`) and the TorchX component's
signature (``components/signature.py``), and :func:`to_argv` turns a dataclass back into the
command line the app parses. A configuration may group its options in sections (:func:`section`:
a field holding a dataclass of options); the command line flattens them, so an option's name is
the same wherever it lives, and :meth:`Options.from_options` builds the sections back from the
flat names. Values use one text form everywhere, the one TorchX's CLI already
uses: lists are comma separated (``64,32,1``), booleans are ``true``/``false``. The app's parser
and the component (``components/signature.py``) read that text with the same :func:`value_parser`,
so a value one accepts the other accepts too, and one refuses the other refuses.
"""

import argparse
import copy
import dataclasses
import math
import typing
from typing import Any, Callable, ClassVar, Mapping, Sequence, TypeVar

from apps.core.common.errors import ConfigError

T = TypeVar("T")
C = TypeVar("C", bound="Options")


def option(default: Any, help: str, *, choices: Sequence[str] | None = None) -> Any:
    """A dataclass field with a default, a help text and optional allowed choices."""
    metadata = {"help": help, "choices": tuple(choices) if choices else None}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.copy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(cls: type) -> Any:
    """A dataclass field holding a section: the dataclass ``cls`` of options, whose names the
    command line flattens (they must differ from every other option's)."""
    return dataclasses.field(default_factory=cls, metadata={"section": cls})


@dataclasses.dataclass(slots=True)
class Options:
    """Base of a dataclass of options and sections of options, built from flat option values.

    Declare the dataclass (and its sections) with ``slots=True``: assigning a name that is no
    option (``cfg.checkpoint_dir`` for ``cfg.checkpoint.checkpoint_dir``) then fails instead of
    silently adding an attribute nothing reads."""

    #: The options (flat names) that were given, or set by a preset, when the configuration was
    #: built (:meth:`from_options`): what a default of the device the run lands on leaves as it
    #: is (apps/core/config.py, :func:`~apps.core.config.with_device_defaults`). Not an option,
    #: and not part of what a configuration is (equality).
    explicit: frozenset[str] = dataclasses.field(default=frozenset(), compare=False, repr=False, kw_only=True)

    #: The options offered (flat names) on the command line and as component arguments; None: all.
    #: A subclass that a tool reads only in part (the plan preview reads the model's) narrows it,
    #: and its other options keep their defaults.
    OFFERED: ClassVar[frozenset[str] | None] = None

    @classmethod
    def preset_defaults(cls, given: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults other than the fields' own for the options not in ``given`` (a preset's
        values); none here."""
        return {}

    @classmethod
    def from_options(cls: type[C], given: Mapping[str, Any]) -> C:
        """The configuration of the options in ``given`` (flat names), the others at their
        defaults (:meth:`preset_defaults`, else the field's); validated."""
        unknown = sorted(set(given) - {field.name for field in options_of(cls)})
        if unknown:
            raise ConfigError(f"unknown options: {', '.join(unknown)}")
        preset = cls.preset_defaults(given)
        config = _build(cls, {**preset, **given})
        config.explicit = frozenset(preset) | frozenset(given)
        return config

    def replace(self: C, **changes: Any) -> C:
        """A copy with the options in ``changes`` changed (flat names), validated anew; those
        join the options given (:attr:`explicit`). Any option may change, offered or not
        (:attr:`OFFERED` narrows what a user gives, not what the configuration holds)."""
        values = option_values(self)
        unknown = sorted(set(changes) - set(values))
        if unknown:
            raise ConfigError(f"unknown options: {', '.join(unknown)}")
        config = _build(type(self), {**values, **changes})
        config.explicit = self.explicit | frozenset(changes)
        return config


def option_values(config: Any) -> dict[str, Any]:
    """Every option's value in the dataclass ``config`` and its sections, by its flat name."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if "section" in field.metadata:
            values.update(option_values(value))
        elif "help" in field.metadata:
            values[field.name] = value
    return values


def _build(cls: type[T], values: Mapping[str, Any]) -> T:
    """``cls`` with each section built from its own options in ``values``."""
    kwargs = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if "section" in field.metadata:
            kwargs[field.name] = _build(field.metadata["section"], values)
        elif field.name in values:
            kwargs[field.name] = copy.copy(values[field.name])
    return cls(**kwargs)


def field_default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def check_choices(config: Any) -> None:
    """Refuses a field of the dataclass ``config`` whose value is not one of its choices.

    argparse checks choices on the app's command line; this also covers a dataclass built
    from TorchX component arguments or in code.
    """
    values = option_values(config)
    for field in options_of(type(config)):
        choices = field.metadata.get("choices")
        value = values[field.name]
        if choices and value not in choices:
            raise ConfigError(f"--{field.name} {value!r} is not supported: use one of {', '.join(choices)}")


TRUE_TEXTS = ("true", "yes", "on", "1")
FALSE_TEXTS = ("false", "no", "off", "0")


def parse_bool(text: str) -> bool:
    """``true``/``false`` (or yes/no, on/off, 1/0, any case); anything else is refused, never false."""
    lowered = text.strip().lower()
    if lowered in TRUE_TEXTS:
        return True
    if lowered in FALSE_TEXTS:
        return False
    raise argparse.ArgumentTypeError(
        f"expected true or false ({'/'.join(TRUE_TEXTS[1:])} or {'/'.join(FALSE_TEXTS[1:])} also work), got {text!r}"
    )


#: The largest float32: training computes in float32 (a fused optimizer's learning rate too).
FLOAT32_MAX = 3.4028234663852886e38


def parse_finite_float(text: str) -> float:
    """A float that arithmetic can use: ``nan`` and ``inf`` pass every range check and then
    poison training, so they are refused here, where the text is read; so are values beyond
    float32's range, which are inf where training computes (a learning rate of 1e39 stopped the
    first step with a traceback from deep in the optimizer)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    if abs(value) > FLOAT32_MAX:
        raise argparse.ArgumentTypeError(f"expected a number within float32's range (+-3.4e38), got {text!r}")
    return value


#: The range of an integer option: torch, numpy and the checkpoints' manifests hold them as int64.
INT64_MAX = 2**63 - 1


def parse_int(text: str) -> int:
    """An integer that torch and numpy can hold (int64): a larger one passed every check and then
    overflowed where a tensor or a seed took it (``--seed 100000000000000000000000``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if abs(value) > INT64_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer within int64's range (+-9.2e18), got {text!r}")
    return value


parse_int.__name__ = "int"  # argparse's "invalid int value", and the lists' "list of int"


parse_finite_float.__name__ = "float"  # a list's "list of float"


def _list_parser(element: Callable[[str], Any]) -> Callable[[str], list]:
    def parse(text: str) -> list:
        if not text.strip():
            return []
        items = [item.strip() for item in text.split(",")]
        if "" in items:  # 64,,16 was read as 64,16: a layer the user meant was silently dropped
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {element.__name__}, got {text!r}, which has an empty entry: "
                "give every entry a value"
            )
        try:
            return [element(item) for item in items]
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {element.__name__}, got {text!r}"
            ) from None

    parse.__name__ = f"list[{element.__name__}]"
    return parse


def value_parser(annotation: Any) -> Callable[[str], Any]:
    """The function that turns the text form of a value of type ``annotation`` into the value."""
    if annotation is bool:
        return parse_bool
    if typing.get_origin(annotation) is list:
        (element,) = typing.get_args(annotation)
        return _list_parser(value_parser(element))
    if annotation is float:
        return parse_finite_float
    if annotation is int:
        return parse_int
    if annotation is str:
        return annotation
    raise TypeError(f"options of type {annotation!r} are not supported")


def format_value(value: Any) -> str:
    """The text form of ``value``, as :func:`value_parser` reads it back."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in value)
    return str(value)


def options_of(cls: type) -> list[dataclasses.Field]:
    """Every option the dataclass ``cls`` offers (:attr:`Options.OFFERED`), its sections'
    included, in declaration order."""
    options = []
    for field in dataclasses.fields(cls):
        if "section" in field.metadata:
            options += options_of(field.metadata["section"])
        elif "help" in field.metadata:
            options.append(field)
    offered = getattr(cls, "OFFERED", None)
    return options if offered is None else [field for field in options if field.name in offered]


def flag(name: str) -> str:
    """An option's flag, as TorchX's CLI spells a component argument: ``-j``, ``--batch_size``."""
    return f"-{name}" if len(name) == 1 else f"--{name}"


def option_types(cls: type) -> dict[str, Any]:
    """Each option's annotation, by its flat name."""
    types = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if "section" in field.metadata:
            types.update(option_types(field.metadata["section"]))
    return types


def help_text(field: dataclasses.Field) -> str:
    choices = field.metadata.get("choices")
    text = field.metadata["help"]
    return f"{text} One of: {', '.join(choices)}." if choices else text


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds one ``--name`` option per option of the dataclass ``cls`` to ``parser``.

    Options not given are left out of the parsed namespace (their default is shown in the help):
    an option given at its default value is told apart from one not given, so that a preset
    fills only the options not given.
    """
    hints = option_types(cls)
    for field in options_of(cls):
        annotation = hints[field.name]
        kwargs: dict[str, Any] = {
            "type": value_parser(annotation),
            "default": argparse.SUPPRESS,
            "help": f"{help_text(field)} (default: {format_value(field_default(field)) or 'empty'})",
            "metavar": field.name.upper() if annotation is not bool else "true|false",
        }
        if annotation is bool:
            kwargs["nargs"] = "?"
            kwargs["const"] = True
        if field.metadata.get("choices"):
            kwargs["choices"] = field.metadata["choices"]
            kwargs["metavar"] = "{" + ",".join(field.metadata["choices"]) + "}"
        parser.add_argument(flag(field.name), **kwargs)


def build_parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    """A parser of ``cls``'s options; help is ``--help`` alone where an option takes ``-h``."""
    parser = argparse.ArgumentParser(prog=prog, description=description, add_help=False)
    takes_h = any(field.name == "h" for field in options_of(cls))
    parser.add_argument(*(["--help"] if takes_h else ["-h", "--help"]), action="help", help="show this help and exit")
    add_options(parser, cls)
    return parser


def parse_config(cls: type[C], argv: Sequence[str] | None, prog: str, description: str) -> C:
    """Parses ``argv`` into a validated ``cls``; a bad value exits with a message naming it."""
    parser = build_parser(cls, prog, description)
    given = vars(parser.parse_args(argv))
    try:
        return cls.from_options(given)
    except ConfigError as e:
        parser.error(str(e))


def to_argv(config: Any) -> list[str]:
    """The command line that :func:`parse_config` turns back into ``config``: the options whose
    value is not the one they would get when not given (the preset's, else the field's)."""
    values = option_values(config)
    defaults = {field.name: field_default(field) for field in options_of(type(config))}
    if isinstance(config, Options):
        preset = type(config).preset_defaults({name: values[name] for name in ("preset",) if name in values})
        defaults.update((name, value) for name, value in preset.items() if name in defaults)
    return [
        token
        for name, default in defaults.items()
        if values[name] != default
        for token in (flag(name), format_value(values[name]))
    ]


def given_options(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """The options among ``values`` that differ from their field's default: what a caller that
    hands every option over, given or not (TorchX's components), can be taken to have given."""
    defaults = {field.name: field_default(field) for field in options_of(cls)}
    return {name: value for name, value in values.items() if name in defaults and value != defaults[name]}
