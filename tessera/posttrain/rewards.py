"""Rewards of GRPO's answers (--grpo-reward): built-in checks of a verifiable answer, or a Python function.

Each reward is called as `reward(prompt, completion, answer) -> float`: the row's prompt (a
string or a list of messages), the sampled answer's text (without its end-of-sequence token)
and the row's "answer" value. The rewards named are summed.

- `exact_match`: 1.0 when the text after the last "####" of the completion (stripped) is the
  answer (stripped, as a string), or both read as the same number ("1,000" and "1000.0"); else
  0.0, and 0.0 when there is no "####". GSM8K's convention for the final answer.
- `format`: 1.0 when --grpo-format-regex is found in the completion (re.search), else 0.0.
- `module:function`: that function, imported (the working directory is on the import path).

A reward that raises, or returns something other than a finite number, stops the run with one
line naming the reward and the prompt's file and line (`score`).
"""

from __future__ import annotations

import importlib
import math
import numbers
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable

from tessera.config import ConfigError

Reward = Callable[[object, str, object], float]
ANSWER_MARK = "####"


def final_answer(completion: str) -> str | None:
    """The text after the last "####", stripped; None without one."""
    head, mark, tail = completion.rpartition(ANSWER_MARK)
    return tail.strip() if mark else None


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def exact_match(prompt, completion: str, answer) -> float:
    given = final_answer(completion)
    if given is None or answer is None:
        return 0.0
    expected = str(answer).strip()
    if given == expected:
        return 1.0
    given_number, expected_number = _number(given), _number(expected)
    return float(given_number is not None and given_number == expected_number)


def format_reward(pattern: str) -> Reward:
    compiled = re.compile(pattern)
    return lambda prompt, completion, answer: float(compiled.search(completion) is not None)


def import_reward(name: str) -> Reward:
    """`module:function`, imported; ConfigError naming --grpo-reward when it cannot be."""
    module_name, _, function_name = name.partition(":")
    if not module_name or not function_name:
        raise ConfigError(f"--grpo-reward {name}: expected exact_match, format or module:function")
    if os.getcwd() not in sys.path:   # a console script's path lacks it; `python -m` has it
        sys.path.append(os.getcwd())
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--grpo-reward {name}: cannot import it ({exc})") from None
    if not callable(function):
        raise ConfigError(f"--grpo-reward {name}: {type(function).__name__} is not callable")
    return function


@dataclass
class Rewards:
    """The rewards of --grpo-reward, by name."""

    functions: dict[str, Reward]

    @classmethod
    def from_flags(cls, names: list[str], format_regex: str) -> "Rewards":
        try:
            re.compile(format_regex)
        except re.error as exc:
            raise ConfigError(f"--grpo-format-regex {format_regex!r}: {exc}") from None
        built = {"exact_match": lambda: exact_match, "format": lambda: format_reward(format_regex)}
        return cls({name: built[name]() if name in built else import_reward(name) for name in names})

    def score(self, prompt, completion: str, answer, where: str) -> list[float]:
        """Each reward's value for one answer to the prompt read at `where` (file:line)."""
        values = []
        for name, function in self.functions.items():
            try:
                value = function(prompt, completion, answer)
            except Exception as exc:  # noqa: BLE001 -- a user's function may raise anything
                raise ConfigError(f"--grpo-reward {name} raised {type(exc).__name__} ({exc}) on the prompt of "
                                  f"{where}") from None
            if isinstance(value, bool):
                value = float(value)
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ConfigError(f"--grpo-reward {name} returned {value!r:.40} on the prompt of {where}: a reward "
                                  "is a finite number")
            values.append(float(value))
        return values
