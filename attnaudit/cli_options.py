"""Option bundles: groups of CLI options declared once and shared by every command.

Typer has no option groups, so each command used to repeat the same fifteen options (data
set, data file, split, output paths...). A bundle is a dataclass whose fields carry their
``typer.Option``; :func:`bundled` splices the fields into a command's signature and hands
the command one bundle object instead::

    @app.command("kappa")
    @bundled(data=DataOptions.defaults(dataset="digits", split="train"), out=OutputBundle)
    def kappa_command(n: ..., data: DataOptions, out: OutputBundle) -> None: ...

Per-command defaults (the presets of ``landscape`` choose the data set when none is given)
are set with :meth:`DataOptions.defaults`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Optional

import typer

_OPTION = "typer_option"


def _field(default: Any, annotation: Any, *decls: str, help: str) -> Any:
    return dataclasses.field(default=default, metadata={_OPTION: (annotation, typer.Option(*decls, help=help))})


@dataclass
class DataOptions:
    """Where the data come from (``--dataset``/``--data``) and how they are filtered and preprocessed."""

    dataset: Optional[str] = _field(
        "digits", Optional[str], "--dataset",
        help="Built-in data set: digits (embedded, offline), mnist, fashion-mnist, cifar10, synthetic.",
    )
    data: Optional[str] = _field(
        None, Optional[str], "--data",
        help="User data: .npz, .npy, .safetensors, .pt, .csv (label column) or an image folder (one sub-folder per class).",
    )
    data_dir: Optional[str] = _field(
        None, Optional[str], "--data-dir",
        help="Root of torchvision-format data sets (default: $ATTNAUDIT_DATA_DIR, else ~/.cache/attnaudit/data).",
    )
    split: Optional[str] = _field("train", Optional[str], "--split", help="train or test.")
    classes: Optional[str] = _field(None, Optional[str], "--classes", help="Keep only these labels, e.g. 0,1,7.")
    preprocess: str = _field("raw", str, "--preprocess", help="raw, center, standardize, unit-norm or ntk-scale (one global scale so that mean ||x||^2 = d, the NTK convention).")
    download: bool = _field(
        False, bool, "--download", help="Allow torchvision to download a missing data set (needs a network)."
    )

    @classmethod
    def defaults(cls, **overrides: Any) -> "type[DataOptions]":
        """This bundle with other defaults (e.g. ``dataset=None`` when a preset chooses)."""
        return _with_defaults(cls, overrides)

    def spec(self, seed: int, *, n: int | None = None, stratify: bool = False,
             dataset: str | None = None, split: str | None = None):
        """A validated :class:`attnaudit.data.DataSpec`; ``dataset``/``split`` fill options left unset."""
        from .data import DataSpec, parse_classes

        return DataSpec(
            dataset=self.dataset or dataset or "digits",
            data=self.data,
            data_dir=self.data_dir,
            split=self.split or split or "train",
            n=n,
            classes=parse_classes(self.classes),
            preprocess=self.preprocess,
            seed=seed,
            stratify=stratify,
            download=self.download,
        )

    def inputs(self) -> dict:
        """The options as given, for the report's ``inputs``."""
        return {
            "dataset": self.dataset if self.data is None else None, "data": self.data, "split": self.split,
            "classes": self.classes, "preprocess": self.preprocess,
        }


@dataclass
class OutputBundle:
    """Where results go (``--json``, ``--png``, ``--out-dir``), how much is printed, and ``--debug``."""

    json: Optional[str] = _field(
        None, Optional[str], "--json", help="Write the JSON report here ('-' = standard output, nothing else printed there)."
    )
    png: Optional[str] = _field(None, Optional[str], "--png", help="Write the figure here (PNG).")
    out_dir: Optional[str] = _field(None, Optional[str], "--out-dir", help="Write report.json and figures into this folder.")
    quiet: bool = _field(False, bool, "--quiet", "-q", help="No table and no progress bar.")
    overwrite: bool = _field(False, bool, "--overwrite", help="Allow replacing existing output files.")
    debug: bool = _field(False, bool, "--debug", help="Show the full traceback on errors.")

    def options(self):
        """The :class:`attnaudit.cli_common.OutputOptions` these flags describe."""
        from .cli_common import OutputOptions

        return OutputOptions(json=self.json, png=self.png, out_dir=self.out_dir, quiet=self.quiet, overwrite=self.overwrite)


@dataclass
class ModelOptions:
    """Which trained model to audit (``--checkpoint``/``--model``, ``--factory`` + ``--weights``)."""

    checkpoint: Optional[list[str]] = _field(
        None, Optional[list[str]], "--checkpoint", "--model",
        help="Audit a trained model: an attnaudit .safetensors (its .json side-car beside it) or a Hugging Face model "
             "folder (config.json + model.safetensors; needs attnaudit[hf]). Repeat to compare several. --model is an alias.",
    )
    factory: Optional[str] = _field(
        None, Optional[str], "--factory",
        help="Your own torch.nn.Module: package.module:function that returns it (called without arguments).",
    )
    weights: Optional[str] = _field(
        None, Optional[str], "--weights", help="Weights for --factory (.safetensors; pickle files need --trust-pickle)."
    )
    trust_pickle: bool = _field(
        False, bool, "--trust-pickle",
        help="Allow pickle-based weights (.pt/.pth/.bin/.ckpt), read with torch.load(weights_only=True). Only for files you trust.",
    )
    inputs: str = _field(
        "auto", str, "--inputs",
        help="How data rows reach a --factory model: auto (its audit_inputs(), else images for image data), flat, images or tokens.",
    )

    @property
    def given(self) -> bool:
        """Whether any model option was given."""
        return bool(self.checkpoint) or self.factory is not None or self.weights is not None

    def sources(self) -> list[str]:
        """What the models were loaded from, for the report."""
        if self.factory is not None:
            return [f"{self.factory}" + (f" + {self.weights}" if self.weights else "")]
        return list(self.checkpoint or [])

    def load(self) -> dict:
        """label -> :class:`attnaudit.checkpoints.LoadedModel`, every file checked (before any data are read)."""
        from .checkpoints import load_model_source, unique_labels

        if self.factory is not None or self.weights is not None:
            if self.checkpoint:
                raise _error("--checkpoint and --factory both name a model; give one of them")
            loaded = [load_model_source(factory=self.factory, weights=self.weights, trust_pickle=self.trust_pickle,
                                        inputs=self.inputs)]
        else:
            loaded = [load_model_source(path, trust_pickle=self.trust_pickle, inputs=self.inputs) for path in self.checkpoint or []]
        return dict(zip(unique_labels([m.label for m in loaded]), loaded))


@dataclass
class ExecutorOptions:
    """Where a sweep's cells run (``--executor``, ``--jobs``, ``--ray-address``, ``--gpus-per-cell``, ``--resume``)."""

    executor: str = _field(
        "local", str, "--executor",
        help="local (cells in this process, or --jobs N worker processes) or ray (Ray tasks; needs attnaudit[ray]).",
    )
    jobs: int = _field(1, int, "--jobs", help="Local worker processes (or the CPUs of a Ray started for the run).")
    ray_address: Optional[str] = _field(
        None, Optional[str], "--ray-address", help="Join this running Ray cluster (default: start a local Ray for the run)."
    )
    gpus_per_cell: float = _field(0.0, float, "--gpus-per-cell", help="GPUs Ray reserves for each cell.")
    resume: Optional[str] = _field(
        None, Optional[str], "--resume",
        help="Folder that keeps every finished cell; a rerun skips the cells already there (same configuration and version).",
    )

    def config(self):
        """The :class:`attnaudit.sweep.ExecutorConfig` these flags describe (validated)."""
        from .sweep import ExecutorConfig

        return ExecutorConfig(kind=self.executor, jobs=self.jobs, ray_address=self.ray_address,
                              gpus_per_cell=self.gpus_per_cell, resume_dir=self.resume)


def _error(message: str):
    from .errors import AuditError

    return AuditError(message)


def _with_defaults(cls: type, overrides: dict) -> type:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(overrides) - names
    if unknown:
        raise TypeError(f"{cls.__name__} has no option(s) {sorted(unknown)}")
    fields = [
        (f.name, f.type, dataclasses.field(default=overrides.get(f.name, f.default), metadata=f.metadata))
        for f in dataclasses.fields(cls)
    ]
    return dataclasses.make_dataclass(cls.__name__, fields, bases=(cls,))


def _parameters(bundle: type) -> list[inspect.Parameter]:
    params = []
    for f in dataclasses.fields(bundle):
        annotation, option = f.metadata[_OPTION]
        params.append(
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=Annotated[annotation, option])
        )
    return params


def bundled(**bundles: type) -> Callable[[Callable], Callable]:
    """Decorator: replace each named parameter of the command by the fields of its bundle class.

    The command receives one instance per bundle. Option names must not clash between
    bundles and the command's own parameters.
    """

    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn, eval_str=True)
        own = [p for name, p in signature.parameters.items() if name not in bundles]
        spliced = list(own)
        taken = {p.name for p in own}
        fields_of: dict[str, list[str]] = {}
        for name, bundle in bundles.items():
            extra = _parameters(bundle)
            clash = taken & {p.name for p in extra}
            if clash:
                raise TypeError(f"option(s) {sorted(clash)} of bundle {name!r} clash with {fn.__name__}'s own")
            taken |= {p.name for p in extra}
            fields_of[name] = [p.name for p in extra]
            spliced.extend(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in extra)
        spliced = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in spliced]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            for name, bundle in bundles.items():
                kwargs[name] = bundle(**{field: kwargs.pop(field) for field in fields_of[name]})
            return fn(**kwargs)

        command.__signature__ = signature.replace(parameters=spliced)
        command.__annotations__ = {p.name: p.annotation for p in spliced}
        return command

    return decorate

