"""The errors an exercise checker raises: its verdicts on a reader's function.

No single chapter shows this module: every chapter's checkers
(:mod:`attnbook.exercises`) raise these errors, and :mod:`attnbook.browser`
prints a stub's verdict in the web page. They live in the library, not among
the checkers, so that the library never imports :mod:`attnbook.exercises`.
"""

from __future__ import annotations


class ExerciseError(AssertionError):
    """The reader's function failed a case. ``mistake`` is the key of the
    diagnosed mistake, if any.

    ``mistake`` is an :class:`attnbook.exercises.Mistake` (its ``key``,
    ``description`` and ``hint`` are used), or None.
    """

    def __init__(
        self,
        exercise: str,
        case: str,
        problem: str,
        mistake=None,
        hint: str | None = None,
    ):
        self.exercise, self.case, self.problem = exercise, case, problem
        self.mistake = mistake.key if mistake else None
        lines = [f"{exercise}: case '{case}': {problem}"]
        if mistake is not None:
            lines.append(f"Diagnosis: {mistake.description}")
            hint = mistake.hint
        if hint:
            lines.append(f"Hint: {hint}")
        super().__init__("\n".join(lines))

    def _render_traceback_(self) -> list[str]:
        """What IPython shows for this error: the verdict alone, without the
        checker's stack frames (which say nothing to a reader and would print
        this machine's paths into the book)."""
        return f"{type(self).__name__}: {self}".split("\n")


class NotAttemptedError(ExerciseError):
    """The reader's function is still the stub that raises
    ``NotImplementedError``."""
