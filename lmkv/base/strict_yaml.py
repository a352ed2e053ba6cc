"""A YAML loader for config files: no anchors or aliases, no duplicate keys.

Aliases let a few hundred bytes expand to millions of nodes (a "billion laughs"
file made ``config check`` print 13 MB); a config never needs them, so the
loader refuses the anchor itself rather than counting expansions. A duplicate
key would silently drop the first value, so it is refused too. A key that is not
text (``1:``, ``null:``, or ``on:``, which YAML 1.1 reads as true) names no
setting, so it is refused with a hint to quote it.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.events import AliasEvent, CollectionStartEvent, ScalarEvent
from yaml.nodes import MappingNode, ScalarNode


class StrictYAMLError(ValueError):
    """What is wrong and on which line (1-based); the caller adds the file name."""


class _StrictLoader(yaml.SafeLoader):
    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, AliasEvent) or (
                isinstance(event, (ScalarEvent, CollectionStartEvent))
                and event.anchor is not None):
            name, mark = event.anchor, event.start_mark
            where = f"line {mark.line + 1}: " if mark is not None else ""
            raise StrictYAMLError(
                f"{where}anchors and aliases (&{name}, *{name}) are not allowed; "
                "write the value out")
        return super().compose_node(parent, index)

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        self.flatten_mapping(node)  # merge keys (<<) first, as SafeLoader does
        seen: set[str] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                shown = key_node.value if isinstance(key_node, ScalarNode) else key
                raise StrictYAMLError(
                    f"line {key_node.start_mark.line + 1}: key {shown!r} reads as "
                    f"{type(key).__name__}, not text; config keys are names (quote it if "
                    "you mean the text)")
            if key in seen:
                raise StrictYAMLError(
                    f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_strict_yaml(text: str) -> Any:
    """``yaml.safe_load`` without anchors, aliases, duplicate or non-text keys."""
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no object tags
