"""The Params of DeepSpark's pyspark.ml stages, made from the schema: one per field of a message, named in Spark's
camelCase, typed, documented and defaulted from proto/deepspark.proto, each with Spark's getter and setter."""

import inspect

from google.protobuf.descriptor import FieldDescriptor
from pyspark import keyword_only
from pyspark.ml.param import Param, Params, TypeConverters

from deepspark import config
from deepspark.errors import ConfigError

_CONVERTERS = {FieldDescriptor.TYPE_BOOL: TypeConverters.toBoolean, FieldDescriptor.TYPE_STRING: TypeConverters.toString,
               FieldDescriptor.TYPE_FLOAT: TypeConverters.toFloat, FieldDescriptor.TYPE_DOUBLE: TypeConverters.toFloat,
               FieldDescriptor.TYPE_UINT32: TypeConverters.toInt, FieldDescriptor.TYPE_INT32: TypeConverters.toInt,
               FieldDescriptor.TYPE_UINT64: TypeConverters.toInt, FieldDescriptor.TYPE_INT64: TypeConverters.toInt}


def camel(name):
    """A schema field's name as a Spark ML Param's: moving_rate -> movingRate."""
    first, *rest = name.split("_")
    return first + "".join(part.title() for part in rest)


def enum_name(field, number):
    """An enum field's value as its Param holds it: the lower-case name (EASGD -> easgd)."""
    return field.enum_type.values_by_number[number].name.lower()


def schema_params(message, skip=()):
    """{Param name: (Param, default, field)} for each field of a schema message: typed, with the .proto's
    comment as its doc and the .proto's default as its default (an enum by its lower-case name)."""
    comments = config.field_comments(message.DESCRIPTOR.name)
    params = {}
    for field in message.DESCRIPTOR.fields:
        if field.name in skip:
            continue
        default = field.default_value
        if field.enum_type is not None:
            default, converter = enum_name(field, default), TypeConverters.toString
        else:
            converter = _CONVERTERS[field.type]
        name = camel(field.name)
        params[name] = (Param(Params._dummy(), name, comments.get(field.name, field.name), converter), default,
                        field.name)
    return params


def title(name):
    return name[0].upper() + name[1:]


def with_schema(*messages, skip=()):
    """A class decorator: the Params of `messages` (schema_params) as class attributes, and `_schema` mapping
    Param names to (message, field, default)."""

    def decorate(cls):
        cls._schema = dict(getattr(cls, "_schema", {}))
        for message in messages:
            for name, (param, default, field) in schema_params(message, skip).items():
                setattr(cls, name, param)
                cls._schema[name] = (message, field, default)
        return cls

    return decorate


def with_accessors(cls):
    """A class decorator, outermost: Spark's get<Name> and set<Name> for each Param of the class that has none, and
    the constructor's and setParams' keyword-only signature of every Param (what help() and an IDE show)."""
    names = sorted(name for name, value in inspect.getmembers(cls) if isinstance(value, Param))
    for name in names:
        if not hasattr(cls, f"get{title(name)}"):
            setattr(cls, f"get{title(name)}", lambda self, p=name: self.getOrDefault(p))
        if not hasattr(cls, f"set{title(name)}"):
            setattr(cls, f"set{title(name)}", lambda self, value, p=name: self._set(**{p: value}))
    signature = inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)]
                                  + [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
                                     for name in names])

    def set_params(self, *args, **kwargs):
        return Stage.setParams(self, *args, **kwargs)

    set_params.__doc__, set_params.__signature__ = Stage.setParams.__doc__, signature
    cls.setParams = set_params
    cls.__init__.__signature__ = signature
    return cls


class Stage(Params):
    """What both stages share: the schema's defaults set at construction, keyword arguments checked by name."""

    def _schema_defaults(self):
        self._setDefault(**{name: default for name, (_, _, default) in self._schema.items()})

    def _set_kwargs(self, kwargs):
        unknown = [key for key in kwargs if not self.hasParam(key)]
        if unknown:
            raise ConfigError(f"{type(self).__name__} has no Param '{unknown[0]}'; its Params are "
                              f"{', '.join(sorted(p.name for p in self.params))}")
        return self._set(**{key: value for key, value in kwargs.items() if value is not None})

    def _given(self, name):
        """The Param's value, or None where it is neither set nor defaulted."""
        return self.getOrDefault(name) if self.isDefined(name) else None

    @keyword_only
    def setParams(self, **kwargs):
        """Sets Params by name (keyword arguments only)."""
        return self._set_kwargs(self._input_kwargs)
