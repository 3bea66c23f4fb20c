"""Rich progress bar for training loops: step, loss, tokens/s, time left.

Shown on rank 0 when stdout is a terminal; under ``nohup`` or in tests the
plain log lines carry the same information.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrainProgress:
    def __init__(self, total_steps: int, enabled: bool = True):
        self.console = Console()
        self.live = enabled and self.console.is_terminal
        self.total = total_steps
        self._progress = None
        self._task = None

    def start(self, step: int) -> None:
        if not self.live:
            return
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}"),
            TextColumn("{task.fields[tok_s]:,.0f} tok/s"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
        )
        self._task = self._progress.add_task("train", total=self.total, completed=step, loss=float("nan"), tok_s=0.0)
        self._progress.start()

    def update(self, step: int, loss: float, tok_s: float) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=loss, tok_s=tok_s)

    def print(self, line: str) -> None:
        (self._progress.console if self._progress else self.console).print(line, highlight=False, markup=False)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
