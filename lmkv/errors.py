"""Exceptions raised by lmkv. Each one carries a message fit for one line."""

from __future__ import annotations


class LMKVError(Exception):
    """Base class of every error lmkv raises on purpose."""


class ConfigError(LMKVError, ValueError):
    """A configuration value is invalid. One line per bad value, naming the key."""


class PluginError(LMKVError):
    """A plugin could not be registered, found or loaded."""


class DuplicatePluginError(PluginError):
    """Two plugins registered the same name for the same kind."""


class UnknownPluginError(PluginError, ConfigError):
    """A configuration selected a plugin name that no installed plugin provides."""


class CorruptFrameError(LMKVError):
    """A stored frame failed to decode or verify; the storage layer treats it as a miss."""


class RefCountError(LMKVError, RuntimeError):
    """A reference or pin count went below zero: a double release."""
