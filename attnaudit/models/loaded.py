"""A model ready to audit, with what is known about it (shared by every checkpoint loader)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from attnaudit.core.task import Inputs, Loss, Task


@dataclass
class LoadedModel:
    """A model ready to audit, with what is known about it.

    ``module``: the network (on the CPU, in eval mode; analyses work on copies or through
    the functional engine, never on it in place). ``inputs``: how the data layer's flat rows
    become its input. ``n_classes``: width of its logits. ``n_features``: flat features per
    sample it expects (None when any size works). ``label``: a short name for tables.
    ``source``: where it came from (``kind``: attnaudit, huggingface or factory; ``path``;
    more keys per kind). ``metadata``: an attnaudit side-car's metadata (training recipe,
    data fingerprint, metrics), ``{}`` when there is none. ``loss``: the loss it was trained
    with when recorded, else None.
    """

    module: nn.Module
    inputs: Inputs
    n_classes: int
    n_features: int | None
    label: str
    source: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)
    loss: str | None = None

    def task(self, loss: str | Loss | None = None, params: str = "all") -> Task:
        """The :class:`~attnaudit.core.task.Task` that audits this model with ``loss``
        (default: the recorded training loss, else ``mse``) over ``params``."""
        return Task(
            self.module,
            self.n_classes,
            loss if loss is not None else (self.loss or "mse"),
            self.inputs,
            params,
            name=self.label,
        )

    @property
    def recipe(self) -> dict | None:
        """The recorded training recipe (attnaudit side-car ``metadata.recipe``), if any."""
        recipe = self.metadata.get("recipe")
        return recipe if isinstance(recipe, dict) else None
