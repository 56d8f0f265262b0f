"""Typed errors of the grammar layer. The server maps each to a gRPC status with details."""

from __future__ import annotations

from dataclasses import dataclass


class GrammarError(Exception):
    """Base of every error the grammar layer raises on user input."""

    reason: str = "GRAMMAR_ERROR"


class InvalidGrammarError(GrammarError):
    """The grammar text, regex or schema is malformed. Carries a location when known."""

    reason = "INVALID_GRAMMAR"

    def __init__(
        self,
        kind: str,
        detail: str,
        *,
        line: int | None = None,
        column: int | None = None,
        pointer: str | None = None,
    ) -> None:
        self.kind = kind
        self.detail = detail
        self.line = line
        self.column = column
        self.pointer = pointer
        where = ""
        if line is not None:
            where = f" at line {line}" + (f", column {column}" if column is not None else "")
        if pointer is not None:
            where += f" at JSON pointer '{pointer}'"
        super().__init__(f"invalid {kind}{where}: {detail}")


class EmptyLanguageError(InvalidGrammarError):
    """The schema is well formed but no JSON value satisfies it, so nothing can be generated:
    refused like a malformed one (same reason), and known to accept nothing."""


class FirstMaskLimitError(InvalidGrammarError):
    """A backend stopped at a limit of its own computing the grammar's first mask: it cannot
    serve this grammar, which says nothing of the grammar itself (another backend may)."""


class UnsupportedGrammarError(GrammarError):
    """A backend was asked for a grammar kind (or feature) it cannot compile."""

    reason = "UNSUPPORTED_GRAMMAR"

    def __init__(self, backend: str, kind: str, detail: str = "") -> None:
        self.backend = backend
        self.kind = kind
        self.detail = detail
        extra = f": {detail}" if detail else ""
        super().__init__(f"backend '{backend}' does not support grammar kind '{kind}'{extra}")


@dataclass(frozen=True)
class KeywordIssue:
    """One schema keyword that a backend does not enforce exactly, at a JSON pointer."""

    keyword: str
    pointer: str
    support: str  # "weakened" or "ignored"
    backend: str = ""
    via: str = ""  # the keyword an exact rewrite of ``keyword`` made, where the issue is found

    def describe(self) -> str:
        where = self.pointer or "/"
        how = f"; rewritten as {self.via}" if self.via else ""
        return f"'{self.keyword}' at {where} ({self.support}{how})"


class SchemaNotEnforceableError(GrammarError):
    """Strict mode: no backend enforces every keyword of the schema."""

    reason = "SCHEMA_NOT_ENFORCEABLE"

    def __init__(self, issues: list[KeywordIssue], backend: str = "auto") -> None:
        self.issues = list(issues)
        self.backend = backend
        listed = "; ".join(issue.describe() for issue in self.issues[:20])
        more = f" (and {len(self.issues) - 20} more)" if len(self.issues) > 20 else ""
        # "auto" tried several backends: say whose reasons these are (they differ per backend)
        owners = sorted({i.backend for i in self.issues if i.backend and i.backend != backend})
        names = ", ".join(f"'{owner}'" for owner in owners)
        whose = f" (the reasons of {names}, the closest backend tried)" if owners else ""
        super().__init__(
            f"schema uses keywords that backend '{backend}' cannot enforce exactly{whose}: "
            f"{listed}{more}. Set the constraint's allow_weakening to generate anyway and get "
            "them reported (espalier's API and CLI; the OpenAI API has no such field: there, "
            "drop or rewrite these keywords)."
        )


class CompileTimeoutError(GrammarError):
    """Compilation did not finish within its time limit."""

    reason = "COMPILE_TIMEOUT"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        super().__init__(f"grammar compilation exceeded its time limit of {seconds:g} s")


class CompileMemoryError(GrammarError):
    """A backend's compile needed more memory than its limit (the compile ran in a child
    process under that limit, and the child ran out of it or died without answering)."""

    reason = "COMPILE_MEMORY_LIMIT"

    def __init__(self, backend: str, limit_bytes: int, detail: str) -> None:
        self.backend = backend
        self.limit_bytes = limit_bytes
        self.detail = detail
        super().__init__(
            f"backend '{backend}' could not compile this grammar within its memory limit of "
            f"{_size(limit_bytes)} ({detail}); another backend may compile it"
        )


class GrammarCostError(GrammarError):
    """A request's grammar made its token masks too slow to keep in a batch: its slow fills
    (each over ``limit_s``) ran ``debt_s`` past that limit in all (an ambiguous grammar's parse
    grows with the text: ``s: s s | "a"`` reaches seconds a token). Ended so the other requests
    go on (``constrained/fill_cost.py``)."""

    reason = "GRAMMAR_TOO_COSTLY"

    def __init__(
        self, seconds: float, limit_s: float, debt_s: float, *, unfinished: bool = False
    ) -> None:
        """unfinished: the last mask was still being computed after ``seconds`` (abandoned)."""
        self.seconds = seconds
        self.limit_s = limit_s
        self.debt_s = debt_s
        last = f"{'still running after ' if unfinished else ''}{seconds * 1e3:.0f} ms"
        super().__init__(
            f"the grammar's token masks took over {limit_s * 1e3:g} ms each, {debt_s:.2f} s past "
            f"that in all (the last {last}): the request was ended so that the "
            "requests batched with it go on; an ambiguous grammar (a rule like `s: s s`) "
            "costs more with every token, an unambiguous one does not"
        )


class UnknownBackendError(GrammarError):
    reason = "UNKNOWN_BACKEND"

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        super().__init__(f"unknown grammar backend '{name}'; choose one of {', '.join(known)}")


def _size(n: int) -> str:
    """``n`` bytes as ``"4 GiB"`` or ``"64 MiB"``."""
    return f"{n / (1 << 30):g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):g} MiB"
