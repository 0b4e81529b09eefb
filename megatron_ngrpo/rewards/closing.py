"""The ``with`` protocol of the graders and their worker pool: ``with obj:`` yields ``obj`` and
calls ``obj.close()`` on exit."""

from __future__ import annotations

from typing import Self


class Closing:
    """Mixin for classes with a ``close()`` that frees their resources."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
