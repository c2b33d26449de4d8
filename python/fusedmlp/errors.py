"""Exceptions raised by fusedmlp.

Every error derives from :class:`FusedMLPError`. Errors about what the caller passed also derive from the built-in
exception a Python user expects (``ValueError`` or ``TypeError``), so ``except ValueError`` keeps working.
"""

__all__ = [
    "FusedMLPError",
    "ArgumentError",
    "ShapeError",
    "ExpressionError",
    "LimitError",
    "DTypeError",
    "LibraryNotFoundError",
    "CompileError",
    "CudaError",
    "TemplateError",
]


class FusedMLPError(Exception):
    """Base class of every error fusedmlp raises."""

    def __init__(self, message, hint=""):
        self.message = message
        self.hint = hint
        super().__init__(message + (f" ({hint})" if hint else ""))


class ArgumentError(FusedMLPError, ValueError):
    """An argument with a value fusedmlp does not accept (an unknown option, a bad device string)."""


class ShapeError(FusedMLPError, ValueError):
    """Weights, biases or inputs whose shapes are wrong or do not chain."""


class ExpressionError(FusedMLPError, ValueError):
    """An activation name or expression that does not parse.

    Attributes:
        expression: the text as given.
        column: 1-based column where parsing failed.
    """

    def __init__(self, message, hint="", expression=None, column=0):
        self.expression = expression
        self.column = column
        super().__init__(message, hint)
        if expression is not None and column > 0:
            # The text and a caret under the failing column come last, after the hint, so nothing follows the caret.
            self.args = (f"{self.args[0]}\n    {expression}\n    {' ' * (column - 1)}^",)


class LimitError(FusedMLPError, ValueError):
    """A valid network beyond what the fused kernel holds (width, depth, shared memory)."""


class DTypeError(FusedMLPError, TypeError):
    """An array of a dtype fusedmlp does not accept."""


class LibraryNotFoundError(FusedMLPError, RuntimeError):
    """libcuda.so.1 or NVRTC could not be found or lacks a needed symbol."""


class CompileError(FusedMLPError, RuntimeError):
    """NVRTC rejected a generated kernel.

    Attributes:
        source: the CUDA source that failed.
        options: the NVRTC options used.
        log: NVRTC's log.
    """

    def __init__(self, message, hint="", source=None, options=(), log=""):
        self.source = source
        self.options = tuple(options)
        self.log = log or ""
        super().__init__(message, hint)
        if self.log:  # the log last: it can be long, and message and hint should not scroll away behind it
            self.args = (f"{self.args[0]}\n{self.log}",)

    def dump(self, stream):
        """Writes the options, the numbered source and the log to a text stream."""
        stream.write(f"NVRTC options: {' '.join(self.options)}\n")
        for number, line in enumerate((self.source or "").splitlines(), 1):
            stream.write(f"{number:5d} {line}\n")
        stream.write(self.log + "\n")


class CudaError(FusedMLPError, RuntimeError):
    """A CUDA driver call failed.

    Attributes:
        code: the CUresult value.
        name: the driver's error name, e.g. ``CUDA_ERROR_OUT_OF_MEMORY``.
    """

    def __init__(self, message, hint="", code=0, name=""):
        self.code = code
        self.name = name
        super().__init__(message, hint)


class TemplateError(FusedMLPError, RuntimeError):
    """A kernel template with unknown or unused placeholders (a packaging bug)."""
