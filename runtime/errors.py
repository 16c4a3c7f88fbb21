"""Errors shared by every runtime component.

:class:`InvalidRequest` is raised wherever a client's input is checked (wire parsing, sampling
parameters, token ids against the vocabulary). It names the offending field so the HTTP layer can
answer 400 with a message such as ``sampling_params.temperature: must be >= 0, got -1``.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request field has a bad value.

    Parameters
    ----------
    field : str
        Dotted path of the field, e.g. ``"sampling_params.top_p"``.
    message : str
        What is wrong, without the field name (``"must be in (0, 1], got 0"``).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type[InvalidRequest], tuple[str, str]]:
        return (type(self), (self.field, self.message))
