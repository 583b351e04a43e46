"""Which topics a sink reads: ``topics`` (names), ``topics.regex`` (Connect's: a Java regex that
must match the whole name) and ``topics.exclude.regex`` (as MirrorMaker 2's ``topics.exclude``).

The patterns are compiled with Python's ``re`` and matched with ``re.fullmatch``, which is what
Java's ``Pattern.matcher(name).matches()`` does; for the patterns topic names call for (``.``,
``*``, ``+``, ``?``, ``|``, ``[...]``, ``(...)``, ``\\d``, ``\\w``, ``{m,n}``) the two agree.
Where they differ: Java's ``\\p{Alpha}``-style classes, class intersection ``[a-z&&[^x]]`` and
``(?<name>...)`` groups are Java-only (Python refuses the first and third with an error, and reads
``&&`` as two literal ampersands); Python's ``(?P<name>...)`` is Python-only. Topic names are
ASCII (``[a-zA-Z0-9._-]``), so Unicode class differences do not arise.

Internal topics (names starting with ``__``: ``__consumer_offsets``, ``__transaction_state``,
Connect's and Schema Registry's ``__``-topics) never match a pattern; a topic named in ``topics``
is read whatever its name.
"""

from __future__ import annotations

import re
from typing import Iterable

from ..errors import ConfigError

INTERNAL_PREFIX = "__"


def compile_topic_regex(pattern: str, key: str) -> re.Pattern:
    """``pattern`` compiled, or a ConfigError naming ``key`` and what is wrong."""
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"{key}: {pattern!r} is not a valid regular expression ({e})") from None


def is_internal(topic: str) -> bool:
    return topic.startswith(INTERNAL_PREFIX)


def match_topics(available: Iterable[str], named: Iterable[str], regex: str | None,
                 exclude: str | None, *, regex_key: str = "topics.regex",
                 exclude_key: str = "topics.exclude.regex") -> list[str]:
    """The topics to read: ``named`` first, in their order, then the ``available`` ones that
    ``regex`` matches whole, are not internal and that ``exclude`` does not match whole, sorted.
    """
    named = list(dict.fromkeys(named))
    out = list(named)
    if regex:
        inc = compile_topic_regex(regex, regex_key)
        exc = compile_topic_regex(exclude, exclude_key) if exclude else None
        seen = set(named)
        for t in sorted(set(available)):
            if t in seen or is_internal(t) or not inc.fullmatch(t):
                continue
            if exc is not None and exc.fullmatch(t):
                continue
            out.append(t)
    elif exclude:
        compile_topic_regex(exclude, exclude_key)
    return out


__all__ = ["INTERNAL_PREFIX", "compile_topic_regex", "is_internal", "match_topics"]
