"""A model's chat template, rendered within bounds of time and memory.

A chat template is code that comes with the model. transformers runs it in jinja2's immutable sandbox, which keeps
it from Python's internals but not from `"x" * 10**10`, `"x"|center(10**10)` or a loop of loops: a template can take
all the memory or all the time there is. gali renders it in the same sandbox, with transformers' own filters,
globals and extensions, and these bounds (one render at a time per thread, each with its own budget):

- every string, list or output piece the template makes counts against MAX_CHARS, in all; an operation whose
  result would pass it (a repetition, a concatenation, a padding width or a format width) is refused before it runs;
- a whole number past MAX_ARGUMENT as an argument, and an integer past MAX_INT_BITS bits, are refused;
- the template runs at most MAX_STEPS block bodies (loop iterations, branches, macro calls) and MAX_SECONDS.

What a template renders for gali is small (messages are placeholders: prompts.template_parts), so the bounds are
far above any real template's needs. Every failure, a syntax error, an undefined name, a sandbox violation or a
bound, is a ModelLoadError naming the model: "the model's chat template ...".
"""

import functools
import re
import time
from contextvars import ContextVar
from dataclasses import dataclass

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from ..errors import ModelLoadError

MAX_TEMPLATE = 2**20  # characters of the template's own source
MAX_CHARS = 2**22  # characters (or items) of everything one render makes, output included
MAX_ARGUMENT = 2**17  # a whole number passed to a filter or method (a width, a count)
MAX_INT_BITS = 2**12  # integers a template computes
MAX_STEPS = 10**6
MAX_SECONDS = 5.0
_FORMAT_WIDTH = re.compile(r"\d{7,}|\*|:[^{}]*\{")  # a width of millions, or one taken from the arguments


class TemplateLimit(SecurityError):
    """A chat template went past one of the bounds of its render."""


@dataclass
class _Budget:
    chars: int = 0
    steps: int = 0
    deadline: float = float("inf")


_BUDGET: ContextVar[_Budget | None] = ContextVar("gali_template_budget", default=None)


def _budget() -> _Budget:
    return _BUDGET.get() or _Budget()  # outside a render (constant folding at compile time): nothing accumulates


def _size(value: object, cap: int) -> int:
    """Characters and items in `value`, as printing it would roughly make them (strings at any depth of lists,
    tuples and dicts); counting stops past `cap`, so a measure costs at most the budget it charges."""
    if isinstance(value, str):
        return len(value)
    if not isinstance(value, (list, tuple, dict)):
        return 1
    size = len(value)
    for item in (value.items() if isinstance(value, dict) else value):
        if size > cap:
            break
        size += _size(item, cap - size)
    return size


def _afford(size: int) -> None:
    """Refuse, before making it, a value of `size` characters or items that would pass the render's budget."""
    if _budget().chars + size > MAX_CHARS:
        raise TemplateLimit(f"it builds more than {MAX_CHARS:,} characters")


def _measure(value: object) -> int:
    return _size(value, MAX_CHARS - _budget().chars)


def _charge(value: object) -> object:
    if isinstance(value, (str, list, tuple, dict)):
        size = _measure(value)
        _afford(size)
        _budget().chars += size
    elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise TemplateLimit(f"it computes an integer of more than {MAX_INT_BITS} bits")
    return value


def _check_arguments(args: tuple, kwargs: dict) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_ARGUMENT:
            raise TemplateLimit(f"it passes {value} where a width or a count goes (at most {MAX_ARGUMENT:,})")


def _check_format(text: object) -> None:
    if isinstance(text, str) and _FORMAT_WIDTH.search(text):
        raise TemplateLimit("it formats with a width of millions of characters or one taken from its arguments")


def _replaced(text: object, old: object, new: object) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        _afford(len(text) + (text.count(old) if old else len(text) + 1) * max(0, len(new) - len(old)))


def _joined(separator: object, items: object) -> None:
    if isinstance(separator, str) and isinstance(items, (list, tuple)):
        _afford(len(separator) * len(items) + _measure(items))


def _estimate_method(method: object, args: tuple) -> None:
    """What a string's replace, join and format would make, refused before they make it (the other methods that
    grow a string take a width, which _check_arguments bounds)."""
    method = getattr(method, "__wrapped__", method)  # the sandbox wraps str.format
    text, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(text, str):
        return
    if name == "replace" and len(args) >= 2:
        _replaced(text, args[0], args[1])
    elif name == "join" and args:
        _joined(text, args[0])
    elif name in ("format", "format_map"):
        _check_format(text)


def _estimate_filter(name: str, args: tuple, kwargs: dict) -> None:
    """The same for the filters that can make much from little."""
    if args and isinstance(args[0], (EvalContext, Context, jinja2.Environment)):
        args = args[1:]  # what pass_eval_context / pass_context / pass_environment add
    value, rest = (args[0], args[1:]) if args else (None, ())
    if name == "replace" and len(rest) >= 2:
        _replaced(value, rest[0], rest[1])
    elif name == "join":
        _joined(rest[0] if rest else kwargs.get("d", ""), value)
    elif name == "format":
        _check_format(value)
    elif name == "indent" and isinstance(value, str):
        width = rest[0] if rest else kwargs.get("width", 4)
        if isinstance(width, str):
            _afford(len(value) + len(width) * (value.count("\n") + 1))
    elif name == "sum" and isinstance(value, (list, tuple)):
        _afford(_measure(value))
    elif name == "tojson" and isinstance(rest[0] if rest else kwargs.get("indent"), str):
        indent = rest[0] if rest else kwargs["indent"]
        _afford(len(indent) * _measure(value))


def _bounded_filter(name: str, function):
    @functools.wraps(function)  # keeps jinja's pass_context / pass_eval_context marks
    def bounded(*args, **kwargs):
        _check_arguments(args, kwargs)
        _estimate_filter(name, args, kwargs)
        return _charge(function(*args, **kwargs))

    return bounded


class _BoundedCode(CodeGenerator):
    """Jinja's code generator with a step counted at every block body and every piece of output (or of a `~`
    concatenation) charged to the render's budget."""

    def blockvisit(self, nodes, frame) -> None:
        self.writeline("environment.gali_step()")
        super().blockvisit(nodes, frame)

    def _output_const_repr(self, group) -> str:
        return f"environment.gali_text({super()._output_const_repr(group)})"

    def _output_child_pre(self, node, frame, finalize) -> None:
        self.write("environment.gali_text(")
        super()._output_child_pre(node, frame, finalize)

    def _output_child_post(self, node, frame, finalize) -> None:
        super()._output_child_post(node, frame, finalize)
        self.write(")")

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.gali_text(")
        super().visit_Concat(node, frame)
        self.write(")")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox for chat templates, with the bounds above."""

    code_generator_class = _BoundedCode
    intercepted_binops = frozenset(["*", "**", "+", "%"])

    @staticmethod
    def gali_step() -> None:
        budget = _budget()
        budget.steps += 1
        if budget.steps > MAX_STEPS:
            raise TemplateLimit(f"it runs more than {MAX_STEPS:,} steps")
        if not budget.steps % 1024 and time.monotonic() > budget.deadline:
            raise TemplateLimit(f"it runs longer than {MAX_SECONDS:g} s")

    @staticmethod
    def gali_text(value):
        return _charge(value)

    def call_binop(self, context, operator: str, left, right):
        if operator == "*":
            for sequence, times in ((left, right), (right, left)):
                if isinstance(sequence, (str, list, tuple)) and isinstance(times, int):
                    _afford(_measure(sequence) * max(times, 0))
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _afford(_measure(left) + _measure(right))
        elif (operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1
              and right * abs(left).bit_length() > MAX_INT_BITS):
            raise TemplateLimit(f"it computes an integer of more than {MAX_INT_BITS} bits")
        elif operator == "%" and isinstance(left, str):
            _check_format(left)
        if (operator == "*" and isinstance(left, int) and isinstance(right, int)
                and left.bit_length() + right.bit_length() > MAX_INT_BITS):
            raise TemplateLimit(f"it computes an integer of more than {MAX_INT_BITS} bits")
        return _charge(super().call_binop(context, operator, left, right))

    def call(self, context, function, /, *args, **kwargs):
        """Every call a template makes (methods and globals): widths, counts and sizes checked first."""
        _check_arguments(args, kwargs)
        _estimate_method(function, args)
        if time.monotonic() > _budget().deadline:
            raise TemplateLimit(f"it runs longer than {MAX_SECONDS:g} s")
        return _charge(super().call(context, function, *args, **kwargs))


@functools.lru_cache(maxsize=1)
def _environment() -> BoundedEnvironment:
    """An environment like the one transformers renders chat templates in (its extensions, filters, globals)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    reference = _compile_jinja_template("").environment  # compiling nothing: only its settings are wanted
    environment = BoundedEnvironment(trim_blocks=reference.trim_blocks, lstrip_blocks=reference.lstrip_blocks,
                                     extensions=[type(extension) for extension in reference.extensions.values()])
    environment.filters.update({name: _bounded_filter(name, function) for name, function in reference.filters.items()})
    environment.globals.update(reference.globals)
    del environment.globals["lipsum"]  # paragraphs of filler by the thousand: no chat template asks for them
    return environment


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    if len(source) > MAX_TEMPLATE:
        raise TemplateLimit(f"it is {len(source):,} characters long (at most {MAX_TEMPLATE:,})")
    return _environment().from_string(source)


def _failure(name: str, error: Exception) -> ModelLoadError:
    if isinstance(error, TemplateLimit):
        what = f"is refused: {error}"
    elif isinstance(error, jinja2.TemplateSyntaxError):
        what = f"does not parse (line {error.lineno}: {error.message})"
    elif isinstance(error, SecurityError):
        what = f"breaks out of its sandbox ({error})"
    else:
        detail = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        what = f"fails ({type(error).__name__}{': ' + detail if detail else ''})"
    return ModelLoadError(f"cannot use model {name!r}: the model's chat template {what}")


_TEMPLATE_ERRORS = (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError, AttributeError,
                    RecursionError, MemoryError)


def _sources(tokenizer) -> list[str]:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return [source for source in template.values() if isinstance(source, str)]
    return [template] if isinstance(template, str) and template else []


def check_chat_template(name: str, tokenizer) -> None:
    """Compile the tokenizer's chat template(s) when the model loads: one that does not parse is refused then."""
    for source in _sources(tokenizer):
        try:
            _compile(source)
        except _TEMPLATE_ERRORS as error:
            raise _failure(name, error) from None


def render_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """What tokenizer.apply_chat_template(messages, tokenize=False) renders, within the bounds above; any failure is
    a ModelLoadError naming the model (the tokenizer's name_or_path, which loading sets to the model's name)."""
    name = str(getattr(tokenizer, "name_or_path", "") or "?")
    token = _BUDGET.set(_Budget(deadline=time.monotonic() + MAX_SECONDS))
    try:
        template = _compile(tokenizer.get_chat_template())
        return "".join(template.generate(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **tokenizer.special_tokens_map))
    except _TEMPLATE_ERRORS as error:
        raise _failure(name, error) from None
    finally:
        _BUDGET.reset(token)
