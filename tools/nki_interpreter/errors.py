"""The one exception type of the NKI interpreter: a kernel broke a rule of the NKI language or hardware."""

from __future__ import annotations


class NkiRuleError(Exception):
    """A kernel broke an NKI rule. ``rule`` is a short stable name (e.g. ``"partition-dim"``) that tests and
    users can match on; the message starts with it in brackets and says what was expected and what came."""

    def __init__(self, rule: str, message: str):
        self.rule = rule
        super().__init__(f"[{rule}] {message}")


def check(cond: bool, rule: str, message: str) -> None:
    """Raise ``NkiRuleError(rule, message)`` unless ``cond``."""
    if not cond:
        raise NkiRuleError(rule, message)
