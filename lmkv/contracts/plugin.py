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

    def startup_warnings(self) -> dict[str, str]:
        """Options that are valid but will not work on this machine as it is now, by
        option name, each with why (the ``cpu`` tier: a ``max_bytes`` past the memory
        available). ``lmkv config check`` prints each as a warning naming its key.
        Whether a config is valid never depends on the moment: the plugin raises
        where the resource is made (a ``ConfigError`` naming the key)."""
        return {}


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
