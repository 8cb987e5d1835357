"""The scorecard's plan: which command lines ``attnaudit claims`` runs, and its protocol variants.

Every run is a library request stated as the command line that reproduces it, so every row
of the scorecard names its command. The variants rerun the malleability comparison under
other protocol choices (eps, damping, optimizer and loss, input scale, loss matching, and
whether the seeds replicate the data split too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from attnaudit.analyses.malleability.run import PRESETS
from attnaudit.analyses.registry import COMMANDS, request_type
from attnaudit.data import PREPROCESS
from attnaudit.analyses.request import FieldError, literal

MODES = ("quick", "full")
#: Seeds of every stochastic run of the scorecard: the sign test of a median seed needs 6 for an exact 95 % interval
#: and about 9 whose signs agree to survive Holm over the nine seed-based rows (docs/findings.md).
DEFAULT_SEEDS = 10


@dataclass(frozen=True)
class RunSpec:
    """One command line of the scorecard."""

    id: str
    command: str
    args: tuple[str, ...]
    purpose: str


# ----------------------------------------------------------------------------- the plan
def _without(args: list[str], flag: str) -> list[str]:
    """``args`` without ``flag`` and its value."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        else:
            out.append(a)
    return out


def _has_choice(command: str, option: str, value: str) -> bool:
    """Whether this build's command accepts ``--option value`` (variants added by newer options)."""
    if not _has_option(command, option):
        return False
    if option == "preprocess":
        return value in PREPROCESS
    return True


def plan(
    mode: str,
    data_args: list[str],
    seed: int,
    n_seeds: int = DEFAULT_SEEDS,
    match_loss: float | str | None = None,
    resample: bool = True,
) -> tuple[list[RunSpec], list[tuple[str, str]]]:
    """The scorecard's runs, and (variant name, run id) of the protocol variants.

    ``n_seeds``: seeds of every stochastic run (ntk-distance, malleability, landscape,
    alignment). ``match_loss``: a common training-loss target for malleability and landscape
    (full-batch GD stops there); the variant rows then also show the other choice.
    ``resample``: every seed also draws its own data split (``--resample-data`` on each run
    that has it; alignment draws its split per seed anyway), so the intervals include the
    choice of training rows; False: the seeds replicate the initialisation only. The last
    variant row shows the other choice."""
    if mode not in MODES:
        raise FieldError("preset", "unknown scorecard {name} " + literal(repr(mode)) + "; use quick or paper")
    if n_seeds < 1:
        raise FieldError("seeds", "{name} must be >= 1, got " + literal(n_seeds))
    if isinstance(match_loss, str):
        if match_loss.strip().lower() not in ("auto", "none"):
            raise FieldError(
                "match_loss",
                "{name}: " + literal(repr(match_loss)) + " is not a training loss; give a number, auto or none",
            )
        match_loss = match_loss.strip().lower()
    elif match_loss is not None and not (math.isfinite(match_loss) and match_loss > 0):
        raise FieldError("match_loss", "{name} must be a positive training loss, got " + literal(match_loss))
    preset = "quick" if mode == "quick" else "paper"
    common = [*data_args, "--seed", str(seed)]
    seeds = ("--seeds", str(n_seeds))
    ml_text = None if match_loss is None else match_loss if isinstance(match_loss, str) else f"{match_loss:g}"
    matched = ("--match-loss", ml_text) if ml_text is not None else ()
    mall_rows = _resample_args("malleability", resample)
    runs = [
        RunSpec("kappa", "kappa", (*common,), "amplification kappa(G~) = kappa(G)^3 and the paper's width requirement"),
        RunSpec(
            "ntk",
            "ntk-distance",
            ("--preset", preset, *common, *seeds, *_resample_args("ntk-distance", resample)),
            "distance to the NTK predictor vs width",
        ),
        RunSpec(
            "malleability",
            "malleability",
            ("--preset", preset, *common, *seeds, *matched, *mall_rows),
            "attn / relu flip-rate ratio with controls",
        ),
        RunSpec(
            "landscape",
            "landscape",
            ("--preset", preset, *common, *seeds, *matched, *_resample_args("landscape", resample)),
            "relative sharpness of the minima",
        ),
    ]
    if _has_command("alignment"):
        # alignment's kernels are closed forms in float64: it takes no --precision
        base = common if _has_option("alignment", "precision") else _without(common, "--precision")
        align = ("--preset", preset, *base, *seeds) if _has_option("alignment", "preset") else (*base, *seeds)
        runs.append(
            RunSpec(
                "alignment",
                "alignment",
                (*align, *_resample_args("alignment", resample)),
                "approximation error on principal-direction targets (the dual implication)",
            )
        )

    main_match = ml_text if ml_text is not None else (PRESETS.get(preset, {}).get("match_loss") or "none")
    variants = [
        (
            "preset protocol, " + ("fixed steps" if main_match == "none" else f"matched training loss ({main_match})"),
            "malleability",
        )
    ]
    extra: list[tuple[str, tuple[str, ...]]] = [
        ("eps 0.1", ("--eps", "0.1")),
        ("damping x100 (0.1)", ("--damping", "0.1")),
    ]
    if _has_choice("malleability", "optimizer", "adam"):
        extra.append(("cross-entropy, Adam lr 1e-3", ("--loss", "ce", "--optimizer", "adam", "--lr", "0.001")))
    if _has_choice("malleability", "preprocess", "ntk-scale"):
        extra.append(("inputs scaled to mean ||x||^2 = d", ("--preprocess", "ntk-scale")))
    for i, (name, args) in enumerate(extra):
        rid = f"malleability-v{i + 1}"
        runs.append(
            RunSpec(
                rid,
                "malleability",
                ("--preset", preset, *common, *seeds, *matched, *mall_rows, *args),
                f"protocol variant: {name}",
            )
        )
        variants.append((name, rid))
    # loss matching as a protocol variant: the other choice from the main run's
    other = _loss_matching_variant(preset, match_loss)
    if other is not None:
        name, args = other
        rid = f"malleability-v{len(variants)}"
        runs.append(
            RunSpec(
                rid,
                "malleability",
                ("--preset", preset, *common, *seeds, *mall_rows, *args),
                f"protocol variant: {name}",
            )
        )
        variants.append((name, rid))
    # what the seeds replicate as a protocol variant: the other choice from the main run's
    if _has_option("malleability", "resample_data"):
        name, args = _resample_variant(resample)
        rid = f"malleability-v{len(variants)}"
        runs.append(
            RunSpec(
                rid, "malleability", ("--preset", preset, *common, *seeds, *matched, *args), f"protocol variant: {name}"
            )
        )
        variants.append((name, rid))
    return runs, variants


def _has_command(name: str) -> bool:

    return name in COMMANDS


def _has_option(command: str, option: str) -> bool:

    return request_type(command).field_of(option) is not None


def _resample_args(command: str, resample: bool) -> tuple[str, ...]:
    """``--resample-data`` when the seeds are to replicate the data split too and ``command`` has it."""
    return ("--resample-data",) if resample and _has_option(command, "resample_data") else ()


def _resample_variant(resample: bool) -> tuple[str, tuple[str, ...]]:
    """The variant row that flips the main runs' data protocol: one fixed split when every seed
    draws its own (``resample``), else a split resampled per seed."""
    if resample:
        return ("fixed data split (seeds replicate the initialisation only)", ())
    return ("data split resampled per seed", ("--resample-data",))


def _loss_matching_variant(preset: str, match_loss: float | str | None) -> tuple[str, tuple[str, ...]] | None:
    """The variant row that flips the loss-matching choice of the main run: fixed steps when the
    main run matches losses (``--match-loss`` given, or the preset's own ``auto``), else matched
    loss by the ``auto`` rule (every model trained to the largest loss any reaches in the budget)."""

    preset_match = PRESETS.get(preset, {}).get("match_loss") or "none"
    matches = preset_match != "none" if match_loss is None else match_loss != "none"
    if matches:
        return ("fixed steps, no loss matching", ("--match-loss", "none"))
    return ("matched training loss (auto)", ("--match-loss", "auto"))
