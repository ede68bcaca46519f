"""The model registry: each model file registers its architecture here when it is imported
(``register``), so a new architecture is one file that registers itself plus one import line in
``models/__init__.py``. ``build_model`` is the one way to build a model from a name and a dict of
config values. A model file also registers how to build a layer of each kind it defines
(``register_layer``); ``build_layer`` builds one layer of a kind ('full', 'window', 'memory', 'xl', ...),
so a config's ``layers`` list can stack layers of several architectures. This module imports no
model: the classes are typed loosely here and checked where they are defined."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .config import RecurformerError, from_dict, suggest


@dataclass(frozen=True)
class Entry:
    config: type[Any]  # the model's config dataclass (a subclass of nn.ModelConfig)
    model: type[Any]  # the model class (a subclass of nn.StreamingLM)
    description: str  # one line for model cards


@dataclass(frozen=True)
class LayerKind:
    config: type[Any]  # the config a layer of this kind needs (a subclass of nn.ModelConfig)
    make: Callable[[Any, int], Any]  # make(config, index) -> the layer (a stack.Layer)


REGISTRY: dict[str, Entry] = {}
LAYER_KINDS: dict[str, LayerKind] = {}

Make = TypeVar("Make", bound=Callable[[Any, int], Any])


def register(name: str, config: type[Any], model: type[Any], description: str) -> None:
    """Add an architecture: ``name`` (the config's ``model.name``), its config and model classes."""
    if name in REGISTRY and REGISTRY[name].model is not model:
        raise RecurformerError(f"model '{name}' is registered twice")
    REGISTRY[name] = Entry(config, model, description)


def register_layer(kind: str, config: type[Any]) -> Callable[[Make], Make]:
    """Decorator on ``make(cfg, index) -> Layer``: layers of ``kind`` are built by ``make`` from a
    config of class ``config`` (or a subclass), in any model's stack."""

    def add(make: Make) -> Make:
        if kind in LAYER_KINDS and LAYER_KINDS[kind].make is not make:
            raise RecurformerError(f"layer kind '{kind}' is registered twice")
        LAYER_KINDS[kind] = LayerKind(config, make)
        return make

    return add


def model_names() -> list[str]:
    return sorted(REGISTRY)


def lookup(name: str) -> tuple[type[Any], type[Any]]:
    """(config class, model class) of a registered model."""
    if not isinstance(name, str) or name not in REGISTRY:
        raise RecurformerError(f"unknown model '{name}'{suggest(str(name), model_names()).replace('keys', 'models')}")
    return REGISTRY[name].config, REGISTRY[name].model


def description(name: str) -> str:
    return REGISTRY[name].description if name in REGISTRY else name


def build_layer(kind: str, cfg: Any, index: int) -> Any:
    """Layer ``index`` of kind ``kind`` ('full', 'window', 'memory', 'xl', ...) for config ``cfg``."""
    if kind not in LAYER_KINDS:
        raise RecurformerError(
            f"unknown layer kind '{kind}' for layer {index}{suggest(kind, sorted(LAYER_KINDS)).replace('keys', 'kinds')}"
        )
    entry = LAYER_KINDS[kind]
    if not isinstance(cfg, entry.config):
        raise RecurformerError(
            f"a '{kind}' layer needs the config of a {entry.config.__name__}, not {type(cfg).__name__}"
        )
    return entry.make(cfg, index)


def config_keys(name: str) -> set[str]:
    """The ``model.*`` keys of a registered model (the init fields of its config)."""
    return {f.name for f in dataclasses.fields(lookup(name)[0]) if f.init}


def make_config(name: str, values: dict[str, Any] | None = None, beside: tuple[str, ...] = ()) -> Any:
    """The config of model ``name`` from ``values``; a key of other models only names them. An
    unknown key names the closest of the config's keys and ``beside``, the keys its section holds
    besides them (a run config's ``name``)."""
    values = dict(values or {})
    keys = config_keys(name)
    for key in values:
        owners = [n for n in model_names() if key in config_keys(n)]
        if owners and key not in keys:
            raise RecurformerError(
                f"config key 'model.{key}' is a setting of {', '.join(owners)}, not of {name}; leave it out for {name}"
            )
        if key not in keys:
            raise RecurformerError(f"unknown config key 'model.{key}'{suggest(key, sorted(keys) + list(beside))}")
    return from_dict(lookup(name)[0], values, where="model")


def model_name(cfg: Any) -> str:
    """The registered name of a config instance's model."""
    for n, entry in REGISTRY.items():
        if type(cfg) is entry.config:
            return n
    raise RecurformerError(f"{type(cfg).__name__} is not a registered config")


def build_model(name: Any, values: dict[str, Any] | None = None) -> Any:
    """``build_model("memory_attention", {"dim": 128})`` or ``build_model(config_instance)``."""
    if not isinstance(name, str):
        cfg, name = name, model_name(name)
    else:
        cfg = make_config(name, values)
    return lookup(name)[1](cfg)
