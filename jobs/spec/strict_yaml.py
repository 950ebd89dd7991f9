"""The YAML reader for specs and overrides: safe, and strict about what it accepts.

Duplicate keys, anchors and aliases are refused, and the size, node count and depth of
what one document may build are bounded (see docs/architecture.md, "Job specs").
"""

from __future__ import annotations

from typing import Any

import yaml

from jobs.domain.errors import SpecError, clip

# What one YAML document may expand to. Aliases are refused outright (a few hundred
# characters of them expand to gigabytes); these bound what plain YAML can build.
MAX_OVERRIDE_CHARS = 64 * 1024
MAX_OVERRIDE_NODES = 10_000
MAX_SPEC_FILE_CHARS = 1024 * 1024
MAX_SPEC_FILE_NODES = 100_000
MAX_YAML_DEPTH = 32


class _StrictLoader(yaml.SafeLoader):
    """A safe loader that refuses duplicate keys, anchors and aliases, and bounds size.

    A duplicate key silently keeps the last value. Aliases let a few hundred characters
    expand to gigabytes (a billion-laughs list), so they are refused as soon as the
    first anchor is seen, before anything is built; the node and depth limits bound what
    plain YAML can build (and keep a deeply nested value from exhausting the stack).
    """

    def __init__(self, text: str, *, where: str, max_nodes: int) -> None:
        super().__init__(text)
        #: Ends refusals: ``in overrides``, ``in a spec file``.
        self.where = where
        self.max_nodes = max_nodes
        self._nodes = 0
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event = self.peek_event()
        line = event.start_mark.line + 1
        name = getattr(event, "anchor", None)
        if name is not None:
            sign = "*" if isinstance(event, yaml.AliasEvent) else "&"
            label = name if len(name) <= 20 else f"{name[:20]}…"
            raise SpecError(
                f"anchors (&name) and aliases (*name) are not allowed {self.where}: write "
                f"the value out (found {sign}{label} on line {line})",
                problems=[("", f"anchor or alias on line {line}")],
            )
        self._nodes += 1
        if self._nodes > self.max_nodes:
            raise SpecError(
                f"the value is too big: more than {self.max_nodes:,} items {self.where}; "
                "put large data in a file and give its path or URI instead",
                problems=[("", f"more than {self.max_nodes:,} items")],
            )
        if self._depth >= MAX_YAML_DEPTH:
            raise SpecError(
                f"the value is nested more than {MAX_YAML_DEPTH} levels deep (line {line}); "
                "flatten it",
                problems=[("", f"nested more than {MAX_YAML_DEPTH} levels deep")],
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            line = key_node.start_mark.line + 1
            raise SpecError(
                f"duplicate key {clip(key)} on line {line}: keep one of them",
                problems=[(str(key), f"duplicate key on line {line}")],
            )
        seen.add(key)
    loader.flatten_mapping(node)
    return dict(loader.construct_pairs(node))


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _mapping_without_duplicates,
)


def load_yaml(text: str, *, where: str, max_nodes: int) -> Any:
    """One YAML document through :class:`_StrictLoader`.

    Raises ``SpecError`` for what the loader refuses, ``yaml.YAMLError`` for bad syntax,
    and ``ValueError`` for a scalar Python cannot hold (an integer past its digit limit,
    a date such as 2024-02-30).
    """
    loader = _StrictLoader(text, where=where, max_nodes=max_nodes)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
