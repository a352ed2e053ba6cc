"""What every plugin class has: a ``name`` and a pydantic ``Options`` model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from lmkv.base.redact import RedactedRepr


class PluginOptions(RedactedRepr, BaseModel):
    """Base of every plugin's options model: unknown keys are an error; its repr
    never shows a secret."""

    model_config = ConfigDict(extra="forbid", frozen=True)


#: What every plugin constructor takes as ``options``: its ``Options`` model, a
#: mapping validated into one, or None (the defaults).
OptionsArg = PluginOptions | Mapping[str, Any] | None


class NoOptions(PluginOptions):
    """Options model of a plugin that takes none."""


class Plugin:
    """Mixin for every plugin class.

    ``name`` is what a config selects (matched case-insensitively);
    ``Options`` validates that plugin's ``options`` mapping.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type[PluginOptions]] = NoOptions

    @classmethod
    def parse_options(cls, options: OptionsArg) -> PluginOptions:
        if isinstance(options, cls.Options):
            return options
        return cls.Options.model_validate(options or {})
