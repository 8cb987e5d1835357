"""The parts of a request that say what is analysed: the data, and a trained model.

:class:`DataFields` and :class:`ModelFields` are mixed into the requests of the commands
that read data or audit a saved model; their fields are the ``Data`` and ``Model /
checkpoint`` options of every such command (:class:`PresetData`: the data fields of a
request whose preset chooses the data set and split). From Python a request can instead hold a
loaded :class:`~attnaudit.data.Dataset` (``loaded_data``) and loaded models
(``loaded_models``: :class:`~attnaudit.models.loaded.LoadedModel` by label).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnaudit.analyses.request import DATA, MODEL, FieldError, Preset, internal, option, unset
from attnaudit.data import DataSpec, parse_classes
from attnaudit.data import load_dataset
from attnaudit.models.checkpoints import load_model_source, unique_labels
from attnaudit.models.hf import is_causal_lm_folder


def _classes(value: Any, name: str) -> str | None:
    """``--classes`` as text ("0,1,7", "0-3"); a YAML list becomes the same text."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


DATASET_HELP = "Built-in data set: digits (embedded, offline), mnist, fashion-mnist, cifar10, synthetic."


@dataclass(frozen=True)
class DataFields:
    """Where the data come from (``dataset`` or ``data``) and how they are filtered and preprocessed."""

    dataset: str | None = option("digits", "--dataset", panel=DATA, help=DATASET_HELP)
    data: str | None = option(
        None,
        "--data",
        panel=DATA,
        metavar="PATH",
        help="User data: .npz, .npy, .safetensors, .pt, .csv (label column) or an image folder (one sub-folder per class).",
    )
    data_dir: str | None = option(
        None,
        "--data-dir",
        panel=DATA,
        metavar="PATH",
        help="Root of torchvision-format data sets (default: $ATTNAUDIT_DATA_DIR, else ~/.cache/attnaudit/data).",
    )
    split: str | None = option("train", "--split", panel=DATA, help="train or test.")
    classes: str | None = option(
        None, "--classes", panel=DATA, parse=_classes, help="Keep only these labels, e.g. 0,1,7."
    )
    preprocess: str = option(
        "raw",
        "--preprocess",
        panel=DATA,
        help="raw, center, standardize, unit-norm or ntk-scale (one global scale so that mean ||x||^2 = d, the NTK convention).",
    )
    download: bool = option(
        False, "--download", panel=DATA, help="Allow torchvision to download a missing data set (needs a network)."
    )
    text_field: str = option(
        "text", "--text-field", panel=DATA, help="Text data (.jsonl, or .csv with this column): the field of each text."
    )
    label_field: str = option("label", "--label-field", panel=DATA, help="Text data: the field of each label.")
    tokenizer: str | None = option(
        None,
        "--tokenizer",
        panel=DATA,
        metavar="PATH",
        help="Text data: tokenizer.json (or a folder holding it); default: the --checkpoint folder's own.",
    )
    max_length: int | None = option(
        None,
        "--max-length",
        panel=DATA,
        kind=int,
        help="Text data: tokens per sample (longer texts truncated, shorter padded); default: the smaller of 128 "
        "and the model's position limit (max_position_embeddings).",
    )
    prompt_field: str | None = option(
        None,
        "--prompt-field",
        panel=DATA,
        help="Documents of a language model (.jsonl): the prompt field; with --completion-field only completion "
        "tokens count in the loss.",
    )
    completion_field: str | None = option(
        None, "--completion-field", panel=DATA, help="Documents of a language model (.jsonl): the completion field."
    )
    loaded_data: Any = internal()

    def data_spec(
        self,
        seed: int,
        *,
        n: int | None = None,
        stratify: bool = False,
        dataset: str | None = None,
        split: str | None = None,
    ):
        """A validated :class:`attnaudit.data.DataSpec`; ``dataset``/``split`` fill options left unset
        (then :meth:`source_defaults`, then digits and train)."""

        default_dataset, default_split = self.source_defaults()
        return DataSpec(
            dataset=self.dataset or dataset or default_dataset or "digits",
            data=self.data,
            data_dir=self.data_dir,
            split=self.split or split or default_split or "train",
            n=n,
            classes=parse_classes(self.classes),
            preprocess=self.preprocess,
            seed=seed,
            stratify=stratify,
            download=self.download,
            text_field=self.text_field,
            label_field=self.label_field,
            tokenizer=self.tokenizer or self.checkpoint_tokenizer(),
            max_length=self.max_length,
            documents=self.reads_documents(),
            prompt_field=self.prompt_field,
            completion_field=self.completion_field,
        )

    def reads_documents(self) -> bool:
        """Whether ``data`` are documents of a causal language model: the audited checkpoint (the
        first ``checkpoint`` folder, or the first loaded model) is one."""
        models = getattr(self, "loaded_models", None) or {}
        if models:
            first = next(iter(models.values()))
            return getattr(first, "source", {}).get("task") == "causal-lm"
        return any(is_causal_lm_folder(c) for c in self.checkpoint_folders()[:1])

    def checkpoint_folders(self) -> list[str]:
        """The ``checkpoint`` entries that are folders (Hugging Face models), in order."""
        checkpoints = getattr(self, "checkpoint", None) or ()
        return [c for c in checkpoints if isinstance(c, str) and Path(c).expanduser().is_dir()]

    def checkpoint_tokenizer(self) -> str | None:
        """The tokenizer of text data when none is named: the first --checkpoint folder's own."""
        folders = self.checkpoint_folders()
        return folders[0] if folders else None

    def source_defaults(self) -> tuple[str | None, str | None]:
        """(data set, split) that :meth:`data_spec` reads when neither the fields nor the caller
        name them (None: digits and train)."""
        return None, None

    def load_data(self, seed: int, *, n: int | None = None, **spec: Any):
        """The :class:`attnaudit.data.Dataset` to analyse: ``loaded_data`` (subset to ``n`` rows
        with ``seed`` when asked), else read as :meth:`data_spec` describes (``spec``: its
        other arguments)."""

        if self.loaded_data is None:
            return load_dataset(self.data_spec(seed, n=n, **spec))
        ds = self.loaded_data
        if n is None or n == ds.n:
            return ds
        if n > ds.n:
            raise FieldError("n", "{name} " + f"{n} is more than the {ds.n} rows of the loaded data set")
        import torch

        rows = torch.randperm(ds.n, generator=torch.Generator().manual_seed(seed))[:n]
        return ds.subset(rows) if hasattr(ds, "subset") else _rows(ds, rows)

    def check(self) -> None:
        """Read the data as the run would (fails here, before any work, on a bad source)."""
        super().check()  # type: ignore[misc]
        if self.loaded_data is None:
            load_dataset(self.data_spec(int(getattr(self, "seed", 0) or 0)))

    def data_inputs(self) -> dict:
        """The data options as given, for the report's ``inputs``."""
        if self.loaded_data is not None:
            return {
                "dataset": getattr(self.loaded_data, "name", "in-memory"),
                "data": None,
                "split": None,
                "classes": None,
                "preprocess": None,
            }
        return {
            "dataset": self.dataset if self.data is None else None,
            "data": self.data,
            "split": self.split,
            "classes": self.classes,
            "preprocess": self.preprocess,
        }


@dataclass(frozen=True)
class PresetData(Preset, DataFields):
    """:class:`DataFields` of a request whose preset (:class:`~attnaudit.analyses.request.Preset`)
    chooses the data set and the split when none is given."""

    dataset: str | None = option(None, "--dataset", panel=DATA, help=DATASET_HELP)
    split: str | None = option(None, "--split", panel=DATA, help="train or test.")

    def source_defaults(self) -> tuple[str | None, str | None]:
        """The preset's data set (unless other data are given) and split."""
        p = self.preset_values()
        return (None if self.data is not None else p["dataset"]), p["split"]

    def preset_fill(self, *names: str) -> dict[str, Any]:
        """The preset's values of the fields left None among the data set (when no other data
        are given), the split and ``names``."""
        p = self.preset_values()
        fill = unset(self, p, ("split", *names))
        if self.dataset is None and self.data is None and self.loaded_data is None:
            fill["dataset"] = p["dataset"]
        return fill

    def preset_data_inputs(self, dataset: str | None, split: str | None) -> dict:
        """:meth:`DataFields.data_inputs` naming the data set and split the run read (those the
        preset filled in, for data read from a source)."""
        data_in = self.data_inputs()
        if self.loaded_data is None:
            data_in.update(dataset=dataset if self.data is None else None, split=split)
        return data_in


def _rows(ds: Any, rows: Any) -> Any:
    import dataclasses

    return dataclasses.replace(ds, X=ds.X[rows], y=ds.y[rows])


# options that only shape how new models are trained (refused with a saved model)
TRAINING_FIELDS = ("width", "steps", "lr", "match_loss", "optimizer", "batch_size")


@dataclass(frozen=True)
class ModelFields:
    """Which trained model to audit (``checkpoint``, or ``factory`` + ``weights``)."""

    checkpoint: tuple[str, ...] | None = option(
        None,
        "--checkpoint",
        panel=MODEL,
        metavar="PATH",
        multiple=True,
        help="Audit a trained model: an attnaudit .safetensors (its .json side-car beside it) or a Hugging Face model "
        "folder (config.json + model.safetensors; needs attnaudit[hf]). Repeat to compare several.",
    )
    factory: str | None = option(
        None,
        "--factory",
        panel=MODEL,
        help="Your own torch.nn.Module: package.module:function that returns it (called without arguments).",
    )
    weights: str | None = option(
        None,
        "--weights",
        panel=MODEL,
        metavar="PATH",
        help="Weights for --factory (.safetensors; pickle files need --trust-pickle).",
    )
    trust_pickle: bool = option(
        False,
        "--trust-pickle",
        panel=MODEL,
        help="Allow pickle-based weights (.pt/.pth/.bin/.ckpt), read with torch.load(weights_only=True). Only for files you trust.",
    )
    inputs: str = option(
        "auto",
        "--inputs",
        panel=MODEL,
        help="How data rows reach a --factory model: auto (its audit_inputs(), else images for image data), flat, images or tokens.",
    )
    loaded_models: Any = internal()

    def refuse_training(self, names: Sequence[str] = TRAINING_FIELDS) -> None:
        """Refuse the fields among ``names`` that are given (not None): they say how new models
        are trained, which does not apply to a saved model."""
        given = [n for n in names if getattr(self, n) is not None]
        if given:
            flags = [self.flag_of(n) for n in given[1:]]  # type: ignore[attr-defined]  # a Request's
            raise FieldError(
                given[0],
                ", ".join(["{name}", *flags]) + " set how new models are trained and do not apply to --checkpoint "
                "(a saved model); drop them",
            )

    @property
    def model_given(self) -> bool:
        """Whether a trained model is to be audited."""
        return bool(self.checkpoint) or self.factory is not None or self.weights is not None or bool(self.loaded_models)

    def model_sources(self) -> list[str]:
        """What the models were loaded from, for the report."""
        if self.loaded_models:
            return [getattr(m, "source", label) for label, m in self.loaded_models.items()]
        if self.factory is not None:
            return [f"{self.factory}" + (f" + {self.weights}" if self.weights else "")]
        return list(self.checkpoint or [])

    def check(self) -> None:
        """Load every model file (fails here, before any data are read)."""
        if self.model_given:
            self.load_models()
        super().check()  # type: ignore[misc]

    def load_models(self) -> dict:
        """label -> :class:`attnaudit.models.loaded.LoadedModel`, every file checked (before any data are read)."""
        if self.loaded_models:
            return dict(self.loaded_models)

        if self.factory is not None or self.weights is not None:
            if self.checkpoint:
                raise FieldError("checkpoint", "{name} and factory both name a model; give one of them")
            loaded = [
                load_model_source(
                    factory=self.factory, weights=self.weights, trust_pickle=self.trust_pickle, inputs=self.inputs
                )
            ]
        else:
            loaded = [
                load_model_source(path, trust_pickle=self.trust_pickle, inputs=self.inputs)
                for path in self.checkpoint or []
            ]
        return dict(zip(unique_labels([m.label for m in loaded]), loaded))
