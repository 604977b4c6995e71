"""The task assigner of the plan: which tasks each site runs in each round (the engine's own
``evaluate`` first, then the plugin's tasks; an evaluation-only round at the end)."""

from __future__ import annotations

from typing import Any

from openfl.component.assigner import Assigner

from .plan import EVALUATE_TASK


class RoundAssigner(Assigner):
    """Every collaborator, every round: ``evaluate`` (what it received, on its own held-out data),
    then the plugin's tasks; after the last training round, one more round of ``evaluate`` alone, so
    that the final model is measured at every site too. ``rounds_to_train`` counts training rounds."""

    def __init__(self, train_tasks: list[str], **kwargs: Any) -> None:
        self.train_tasks = list(train_tasks)
        super().__init__(**kwargs)

    def define_task_assignments(self) -> None:
        self.all_tasks_in_groups = [EVALUATE_TASK, *self.train_tasks]

    def tasks_of_round(self, round_number: int) -> list[str]:
        return [EVALUATE_TASK, *self.train_tasks] if round_number < self.rounds else [EVALUATE_TASK]

    def get_tasks_for_collaborator(self, collaborator_name: str, round_number: int) -> list[str]:
        return self.tasks_of_round(round_number)

    def get_collaborators_for_task(self, task_name: str, round_number: int) -> list[str]:
        return list(self.authorized_cols) if task_name in self.tasks_of_round(round_number) else []

    def get_all_tasks_for_round(self, round_number: int) -> list[str]:
        return self.tasks_of_round(round_number)
