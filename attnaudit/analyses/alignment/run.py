"""`alignment` as a request and a run: the target alignment of the attention kernel.

:class:`AlignmentRequest` is what ``attnaudit alignment`` asks (its fields are the command's
options; :data:`~attnaudit.analyses.alignment.alignment.PRESETS` fill the ones left unset) and
:func:`run` answers it with a :class:`~attnaudit.analyses.result.Result` whose report is the
one the command writes. The protocol itself is :func:`~attnaudit.analyses.alignment.alignment.run_alignment`.

Sign conventions of the report (see attnaudit/analyses/alignment/alignment.py and docs/alignment.md): every
``*_advantage_attn`` is relu minus attn for errors and attn minus relu for CKA, so a
positive value always means attention does better; a ``*_contrast`` is the advantage on the
principal target minus that on the random (or trailing) one, positive = the paper's claim.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import ClassVar

from attnaudit.analyses.alignment.alignment import PRESETS, TARGETS
from attnaudit.analyses.request import ANALYSIS, PROTOCOL, DeviceField, FieldError, Request, SeedField, check_seeds
from attnaudit.analyses.request import (
    HiddenWidth,
    LearningRate,
    LrFraction,
    PresetField,
    SeedCount,
    SplitRows,
    list_of,
    option,
    redefault,
)
from attnaudit.analyses.result import Progress, Result, progress_or_silent
from attnaudit.analyses.sources import DataFields, PresetData
from attnaudit.analyses.alignment.alignment import SCHEMA, run_alignment
from attnaudit.analyses.alignment.report import PNG_NAME, build_tables, plot_alignment
from attnaudit.report.envelope import build_report
from attnaudit.runtime.device import resolve_device
from attnaudit.analyses.alignment.alignment import AlignmentConfig


@dataclass(frozen=True)
class AlignmentRequest(
    PresetData,
    SeedField,
    DeviceField,
    PresetField,
    SplitRows,
    SeedCount,
    HiddenWidth,
    LearningRate,
    LrFraction,
    Request,
):
    """What ``attnaudit alignment`` computes; every field is one option.

    Kernel ridge and trained-net errors, and CKA, of 2L-ReLU and MLP-Attn on targets aligned
    with the data's principal, trailing or random directions (and the labels). The fields left
    None are filled by the preset (:meth:`resolved`); an explicit value beats the preset.
    :meth:`resolve` gives the :class:`~attnaudit.analyses.alignment.alignment.AlignmentConfig`
    the run uses, which also checks the protocol's values.
    """

    COMMAND = "alignment"
    PRESETS: ClassVar[dict[str, dict]] = PRESETS

    # the preset chooses the data set and split when none is given (PresetData); the data are centred by default
    preprocess: str = redefault(DataFields, "preprocess", "center")

    preset: str = redefault(
        PresetField,
        "preset",
        help="quick (default; digits, n_train 500, about a minute on 2 CPU cores) or paper (MNIST train split, "
        "n_train 1000; pass --split test for the test-only copy). Explicit options override it.",
    )
    n_train: int | None = redefault(
        SplitRows, "n_train", help="Training rows per seed (a seeded, stratified split; default from --preset)."
    )
    n_test: int | None = redefault(
        SplitRows, "n_test", help="Test rows per seed, disjoint from the training rows (default from --preset)."
    )
    seeds: int = redefault(
        SeedCount,
        "seeds",
        5,
        help="Seeds seed, seed+1, ...: each sets the split, the target's random weights and directions, and the nets' init.",
    )
    width: int | None = redefault(
        HiddenWidth, "width", help="Hidden width of the trained nets (default from --preset)."
    )
    steps: int | None = option(
        None,
        "--steps",
        panel=PROTOCOL,
        kind=int,
        help="Full-batch GD step budget to reach the matched loss (default from --preset).",
    )
    lr: float | None = redefault(
        LearningRate,
        "lr",
        help="GD learning rate of both nets (default: --lr-fraction * 2n / lambda_max of each model's analytic NTK).",
    )
    lr_fraction: float = redefault(
        LrFraction,
        "lr_fraction",
        0.5,
        help="Fraction of GD's stability bound 2n / lambda_max used when --lr is not given.",
    )
    match_loss: float | None = option(
        None,
        "--match-loss",
        panel=PROTOCOL,
        kind=float,
        help="Matched training loss: GD stops at this relative training MSE ||f - y||^2/||y||^2; a net that does not "
        "reach it is flagged and left out of the net comparisons (default from --preset: 0.1).",
    )
    nets: bool = option(
        True,
        "--nets",
        panel=PROTOCOL,
        negative="--no-nets",
        help="Train the finite nets too (--no-nets: kernel regression and CKA only).",
    )
    targets: tuple[str, ...] | None = option(
        None,
        "--targets",
        panel=ANALYSIS,
        parse=list_of(str),
        help="Targets, comma-separated: principal, trailing, random, labels (default all).",
    )
    k: int = option(5, "--k", panel=ANALYSIS, help="Directions per designed target (top-k, trailing-k or k random).")
    ridge: float = option(
        1e-3,
        "--ridge",
        panel=ANALYSIS,
        help="Kernel ridge relative to the kernel's mean eigenvalue: lambda = ridge * trace(K) / n.",
    )
    attn_scaling: str = option(
        "rms",
        "--attn-scaling",
        panel=ANALYSIS,
        help="MLP-Attn context scaling: rms (default, as the models), spectral or none.",
    )
    rank_tol: float | None = option(
        None,
        "--rank-tol",
        panel=ANALYSIS,
        kind=float,
        help="Relative tolerance of the numerical rank that bounds the trailing directions (default max(n,d)*eps).",
    )

    @property
    def target_list(self) -> tuple[str, ...]:
        """The targets asked for (lower case), all of them by default."""
        return tuple(str(t).strip().lower() for t in self.targets) if self.targets is not None else TARGETS

    def resolved(self) -> AlignmentRequest:
        """This request with every field left None filled from its preset (explicit beats preset):
        the data set and split, ``n_train``, ``n_test``, ``width``, ``steps`` and ``match_loss``."""
        fill = self.preset_fill("n_train", "n_test", "width", "steps", "match_loss")
        return dataclasses.replace(self, **fill) if fill else self

    def resolve(self) -> AlignmentConfig:
        """The :class:`~attnaudit.analyses.alignment.alignment.AlignmentConfig` this request runs
        (its preset filled); the configuration checks every value, naming the request's field."""
        r = self.resolved()
        # the preset fills every size
        assert r.n_train is not None and r.n_test is not None and r.width is not None and r.steps is not None
        assert r.match_loss is not None
        return AlignmentConfig(
            k=r.k,
            ridge=r.ridge,
            targets=r.target_list,
            seeds=tuple(range(r.seed, r.seed + r.seeds)),
            n_train=r.n_train,
            n_test=r.n_test,
            width=r.width,
            steps=r.steps,
            lr=r.lr,
            lr_fraction=r.lr_fraction,
            match_loss=r.match_loss,
            nets=r.nets,
            attn_scaling=str(r.attn_scaling).strip().lower(),
            rank_tol=r.rank_tol,
        )

    # ---- validation (before anything is read)
    def validate(self) -> None:
        self.check_preset()
        check_seeds(self.seed, self.seeds, rule="a positive integer", integer=True)
        if self.targets is not None and not self.targets:
            raise FieldError("targets", "{name} is empty; give some of " + ", ".join(TARGETS))
        self.resolve()  # the configuration checks the protocol's values


def run(request: AlignmentRequest, *, progress: Progress | None = None, executor=None) -> Result:
    """Run ``request``; the report is the one ``attnaudit alignment --json`` writes.

    ``executor`` is accepted for the common signature; the seeds run in this process."""
    from rich.text import Text

    progress = progress_or_silent(progress)
    r = request.resolved()
    config = r.resolve()
    dev = resolve_device(r.device)
    t0 = time.perf_counter()
    ds = r.load_data(r.seed, n=None)
    load_s = time.perf_counter() - t0
    header = (
        f"alignment: {ds.name} ({r.split}), {ds.n} rows, d={ds.d}; n_train {config.n_train}, n_test "
        f"{config.n_test}, k {config.k}, ridge {config.ridge:g}, "
        + (
            f"nets width {config.width}, <= {config.steps} GD steps to relative MSE {config.match_loss:g}, "
            if config.nets
            else "kernels only, "
        )
        + f"{r.seeds} seed(s)"
    )
    with progress("alignment", len(config.seeds), "seeds") as advance:
        result = run_alignment(ds, config, device=dev, progress=advance)
    timings = {"load": load_s, **result.timings, "total": time.perf_counter() - t0}
    data_in = request.preset_data_inputs(r.dataset, r.split)
    report = build_report(
        SCHEMA,
        inputs={
            **data_in,
            "preset": request.preset_key,
            "n_train": config.n_train,
            "n_test": config.n_test,
            "seeds": r.seeds,
            **{k_: v for k_, v in config.to_dict().items() if k_ not in ("n_train", "n_test", "seeds")},
        },
        seeds={
            "base_seed": r.seed,
            "seeds": list(config.seeds),
            "rule": "seed s: holdout split seed s, target weights/directions numpy default_rng([s, 0xA11]), "
            "net init seed s (both models)",
        },
        device=dev,
        dtype="float64",
        timings=timings,
        results={"dataset": ds.info, **result.to_dict()},
        warnings=result.warnings,
        verdicts=result.verdicts(),
        request=request,
    )
    title = (
        f"{ds.name}: n_train {config.n_train}, n_test {config.n_test}, k {config.k}, ridge {config.ridge:g}, "
        f"{len(config.seeds)} seeds"
    )
    return Result(
        report,
        request,
        renderables=[Text(header), *build_tables(result)],
        plot=lambda path: plot_alignment(result, path, title),
        png_name=PNG_NAME,
    )
