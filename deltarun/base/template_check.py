"""Checking a model's chat template when the file is opened, not when the first chat starts.

`validate_chat_template` parses the template in the environment chat rendering uses
(`chat_template.make_environment`: transformers' settings), so a template with a syntax error is
reported with its line at load time as a `TokenizerError`.
"""

from __future__ import annotations

from deltarun.base.chat_template import make_environment
from deltarun.base.errors import TokenizerError


def validate_chat_template(template: str) -> None:
    """Raise `TokenizerError` (with the line and Jinja's reason) unless `template` parses."""
    if not isinstance(template, str):
        raise TokenizerError(f"the chat template must be a string, found {type(template).__name__}")
    from jinja2 import TemplateSyntaxError

    try:
        make_environment().parse(template)
    except TemplateSyntaxError as e:
        line = ""
        if e.lineno and template:
            lines = template.splitlines()
            if 0 < e.lineno <= len(lines):
                line = f": {lines[e.lineno - 1].strip()[:80]!r}"
        raise TokenizerError(f"the chat template is not valid Jinja (line {e.lineno}: {e.message}{line}); "
                             f"fix the template stored in the file or convert the model again") from e
    except (RecursionError, MemoryError, ValueError) as e:
        raise TokenizerError(f"the chat template cannot be parsed ({type(e).__name__}: {e})") from e
