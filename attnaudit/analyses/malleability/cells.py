"""One cell of the protocol: one seed x one model (its trainings, attacks and influence runs).

A cell is a pure function of its payload (:func:`malleability_cell`), so an executor may run it
in this process, a worker process or on Ray (:mod:`attnaudit.runtime.sweep`). What every cell
of a run shares is built once per run and passed down: the data and the saved models
(:class:`CellState`, cached per process) and the settings (:class:`CellPlan`: the config, each
model's training settings and loss target, every attack's settings).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from attnaudit.analyses.influence.influence import influence_sweep, tracin_weights
from attnaudit.analyses.malleability.attacks import TOKEN_ATTACKS, AttackConfig, perturb
from attnaudit.analyses.malleability.cell_tools import (
    as_embedding_rows,
    EVAL_ROWS,
    attack_key,
    diagnostics_row,
    embedding_attacked,
    influence_key,
    logits_of,
    pair_key,
    split_info,
    token_edits,
    working_copy,
)
from attnaudit.analyses.malleability.config import LM_LOSS, REINIT_SEED_OFFSET, MalleabilityConfig
from attnaudit.analyses.malleability.lm_attacks import documents_summary, evaluate_documents
from attnaudit.analyses.malleability.precision_check import influence_precision_check
from attnaudit.analyses.malleability.stability import stability_by_k
from attnaudit.analyses.malleability.training import sampled_curve, train_builtin
from attnaudit.core.fit import fit as fit_recipe
from attnaudit.core.task import Task
from attnaudit.core.training import TrainConfig, TrainResult, accuracy, loss_value
from attnaudit.data import HoldoutRecipe
from attnaudit.analyses.request import FieldError
from attnaudit.errors import AuditError
from attnaudit.runtime.sweep import cached


@dataclass(frozen=True)
class CellPlan:
    """The settings every cell of one phase of a run computes with, built once per run
    (:meth:`of`): the config, each model's loss target (``targets``; None: the whole step
    budget), its full-batch GD settings and every attack's settings by (attack, eps, seed)."""

    config: MalleabilityConfig
    targets: Mapping[str, float | None]
    train_configs: Mapping[str, TrainConfig]
    attacks: Mapping[tuple[str, float, int], AttackConfig]

    @classmethod
    def of(
        cls, config: MalleabilityConfig, value_range: tuple | None, targets: Mapping[str, float | None] | None = None
    ) -> CellPlan:
        """The plan of ``config`` on data in ``value_range``; ``targets``: the loss targets
        (default: the config's match_loss of each model, None for an unresolved auto)."""
        targets = {m: config.match_loss_for(m) for m in config.models} if targets is None else dict(targets)
        trains = _train_configs(config, targets)
        return cls(config, targets, trains, config.attack_configs(value_range))

    def with_targets(self, targets: Mapping[str, float | None]) -> CellPlan:
        """This plan with the models trained to ``targets`` (the attacks' settings kept)."""
        trains = _train_configs(self.config, targets)
        return replace(self, targets=dict(targets), train_configs=trains)


def _train_configs(config: MalleabilityConfig, targets: Mapping[str, float | None]) -> dict[str, TrainConfig]:
    """Each built-in model's GD settings; none for a language model (it is audited as saved, and
    the GD settings name a classification loss)."""
    if config.loss == LM_LOSS:
        return {}
    return {m: config.train_config(m, targets[m]) for m in config.models}


@dataclass
class CellState:
    """A malleability run's rows and saved models, shared by its cells in one process (cached per
    data key: a worker loads its rows once), with the plan its cells run under."""

    X_train: torch.Tensor
    y_train: torch.Tensor
    X_test: torch.Tensor
    y_test: torch.Tensor
    n_classes: int
    plan: CellPlan
    fixed_models: dict | None
    rebuild: dict
    split: dict | None = None
    # influence results by the sha256 of everything they depend on (influence_key): a run on
    # identical inputs (the static protocol's clean run, or a deterministic attack's, repeated
    # for every seed) is computed once
    influence_memo: dict = field(default_factory=dict)
    # seedless attacks' results by the sha256 of the model, rows and settings (attack_key)
    attack_memo: dict = field(default_factory=dict)
    # a saved model's working copy and its evaluation on the training rows, by model name: the
    # same for every seed
    saved_memo: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.X_train = self.X_train.to(torch.float64)
        self.X_test = self.X_test.to(self.X_train.device, torch.float64)
        self.y_train = self.y_train.to(self.X_train.device).long()
        self.y_test = self.y_test.to(self.X_train.device).long()
        self.rebuild = self.rebuild or {}


def cell_state(payload: dict) -> CellState:
    """The cell's data and settings: cached per data key (a worker reuses its loaded rows), with
    the payload's own plan (a budget run and the matched run share the rows, not the plan)."""

    def build() -> CellState:
        recipe = HoldoutRecipe(**payload["data"])
        train_ds, test_ds = recipe.load()
        dev = torch.device(payload["device"])
        return CellState(
            train_ds.X.to(dev),
            train_ds.y.to(dev),
            test_ds.X.to(dev),
            test_ds.y.to(dev),
            int(payload["n_classes"]),
            payload["plan"],
            None,
            {},
            split=split_info(train_ds.X, train_ds.y, recipe),
        )

    state = cached(f"malleability:{payload['memory_key']}", build)
    if state.plan != payload["plan"]:
        state = replace(state, plan=payload["plan"])
    return state


def malleability_cell(payload: dict) -> dict:
    """One seed x model cell (a pure function of ``payload``): its trainings, attacks, influence
    and stability rows, unaggregated."""
    return Cell(cell_state(payload), int(payload["seed"]), payload["arch"]).run()


def budget_loss_cell(payload: dict) -> dict:
    """The clean training loss of one seed x model trained for the whole step budget (the
    measurement ``match_loss="auto"`` resolves its target from)."""
    state = cell_state(payload)
    config, seed, arch = state.plan.config, int(payload["seed"]), payload["arch"]
    spec = config.model_spec(arch, int(state.X_train.shape[1]), state.n_classes, seed)
    what = f"budget run, seed {seed}"
    gd = state.plan.train_configs[arch]
    _, tr = train_builtin(config, spec, state.X_train, state.X_train, state.y_train, seed, what, gd)
    return {"seed": seed, "model": arch, "final_loss": float(tr.final_loss), "steps_run": int(tr.steps_run)}


class InfluenceRun(NamedTuple):
    """One influence run of a cell: the influence vectors per damping, the absolute dampings they
    used (None for TracIn), the key of its inputs (None for TracIn) and each training row's loss
    at the model when the estimator's own forward passes gave it (None otherwise)."""

    scores: list
    dampings: list
    key: str | None
    train_losses: torch.Tensor | None


class Cell:
    """The protocol for one seed and one model (see :mod:`attnaudit.analyses.malleability.malleability`):
    the clean model, the training-randomness control, then every attack; :meth:`run` returns
    the cell's rows."""

    def __init__(self, state: CellState, seed: int, arch: str) -> None:
        self.state, self.seed, self.arch = state, seed, arch
        self.plan, self.config = state.plan, state.plan.config
        self.fixed = state.fixed_models
        self.X_train, self.X_test = state.X_train, state.X_test
        model = self.fixed[arch] if self.fixed else None
        if self.fixed and isinstance(model, Task) and embedding_attacked(model, self.config):
            text_model, (self.X_train, self.X_test) = as_embedding_rows(model, self.X_train, self.X_test)
            self.fixed = {**self.fixed, arch: text_model}
        self.y_train, self.y_test = state.y_train, state.y_test
        self.rows: dict[str, list] = {
            key: [] for key in ("runs", "controls", "training", "attacks", "diagnostics", "precision_check")
        }
        self.infl_warnings: dict[str, int] = {}
        self.examples: dict = {}
        self.edits: list[dict] = []
        self.timings = {"train": 0.0, "attack": 0.0, "influence": 0.0}
        self.spec = (
            None if self.fixed else self.config.model_spec(arch, int(self.X_train.shape[1]), state.n_classes, seed)
        )

    # ------------------------------------------------------------------ the protocol
    def run(self) -> dict:
        config = self.config
        clean_model, clean_tr, clean_row, attack_target = self.clean_model()
        clean = self.influences(clean_model, self.X_train, clean_tr, "clean")
        if self.deferred_losses:
            self.settle_saved_loss(clean_model, clean_tr, clean_row, clean.train_losses)
        if config.precision != "float64" and self.seed == config.seeds[0] and config.estimator != "tracin":
            check = influence_precision_check(
                clean_model, self.X_train, self.y_train, self.X_test, self.y_test, config, self.state.n_classes
            )
            self.rows["precision_check"].append({"model": self.arch, "seed": self.seed, **check.to_dict()})
        if config.controls:
            control = self.control(clean)
        for eps in config.eps:
            for attack in config.attacks:
                if attack == "none" and eps != config.eps[0]:
                    continue
                self.attack(attack, eps, attack_target, (clean_model, clean_tr, clean_row), clean)
        if self.seed == config.seeds[0] and config.controls:
            self.examples.setdefault(self.arch, {})[config.control] = (clean.scores[0], control[0])
        split = self.state.split
        if split is not None:
            for row in self.rows["training"]:
                row["train_data_sha256"] = split["train_data_sha256"]
                row["split_seed"] = split["split_seed"]
        return {
            **self.rows,
            "influence_warnings": self.infl_warnings,
            "examples": self.examples,
            "edits": self.edits,
            "split": split,
            "timings": self.timings,
        }

    def clean_model(self) -> tuple[Any, TrainResult, dict, Any]:
        """(model, its training, its row, the model the adversary attacks): trained here
        (built-in), re-run from the recorded recipe (retrain), fine-tuned or as saved."""
        config, arch = self.config, self.arch
        if self.fixed and config.protocol == "retrain":
            k = config.seeds.index(self.seed)
            rb = self.state.rebuild[arch]
            self.init_seed, self.order_seed = rb.init_seed + k, rb.recipe.seed + k
            model, tr, row = self.refit(self.init_seed, self.order_seed, self.X_train, self.X_train, "clean")
            return model, tr, row, model
        if self.fixed:
            self.saved = self.given("saved" if config.protocol == "finetune" else "clean")
            if config.protocol == "finetune":
                model, tr, row = self.finetune(self.saved[0], self.X_train, self.seed, "clean")
            else:
                model, tr, row = self.saved
            return model, tr, row, self.saved[0]  # the adversary perturbs against the model it can see
        assert self.spec is not None  # built-in models
        model, tr, row = self.fit(self.spec, self.X_train, self.X_train, "clean")
        return model, tr, row, model

    def control(self, clean: InfluenceRun) -> list:
        """The training-randomness control (reinit, or reorder under finetune) and its comparison rows."""
        config, seed, arch = self.config, self.seed, self.arch
        control_seed = seed + REINIT_SEED_OFFSET
        if self.fixed and config.protocol == "retrain":
            control_seed = self.init_seed + REINIT_SEED_OFFSET
            model, tr, row = self.refit(control_seed, self.order_seed, self.X_train, self.X_train, config.control)
        elif self.fixed:
            model, tr, row = self.finetune(self.saved[0], self.X_train, control_seed, config.control)
        else:
            assert self.spec is not None  # built-in models
            spec = replace(self.spec, seed=control_seed)
            model, tr, row = self.fit(spec, self.X_train, self.X_train, config.control, order_seed=control_seed)
        infl, absolute, key, _ = self.influences(model, self.X_train, tr, config.control)
        clean_infl, clean_abs, clean_key, _ = clean
        for damping, ci, ri, ca, ra in zip(config.damping, clean_infl, infl, clean_abs, absolute):
            self.rows["controls"].append(
                {
                    "seed": seed,
                    "model": arch,
                    "control": config.control,
                    "damping": damping,
                    "damping_abs": ra,
                    "damping_abs_clean": ca,
                    f"{'data_order' if config.protocol == 'finetune' else 'reinit'}_seed": control_seed,
                    "inputs_sha256": pair_key(clean_key, key),
                    # the control reproduced the clean influence run bit for bit: it varied nothing
                    "same_as_clean": clean_key is not None and key == clean_key,
                    **stability_by_k(ci, ri, config.top_ks),
                    "perturbed_test_accuracy": row["test_accuracy"],
                    "perturbed_train_loss": row["final_loss"],
                }
            )
        return infl

    def attack(self, attack: str, eps: float, target: Any, clean_run: tuple, clean: InfluenceRun) -> None:
        """Perturb the training rows against ``target``, get the model of the perturbed data
        (retrained, fine-tuned or the clean one) and compare its influence with the clean run."""
        config, seed, arch = self.config, self.seed, self.arch
        clean_model, clean_tr, clean_row = clean_run
        ares, first_seed, clean_on_pert = self.perturbed(target, self.plan.attacks[(attack, eps, seed)])
        eps_used = 0.0 if attack == "none" else eps
        role = f"{attack}@{eps_used:g}"
        if config.protocol == "retrain":
            attn = (self.state.rebuild[arch].spec.arch if self.fixed else arch) == "attn"
            ctx = ares.X_adv if (attn and config.attn_context == "perturbed") else self.X_train
            if self.fixed:
                p_model, p_tr, p_row = self.refit(self.init_seed, self.order_seed, ctx, ares.X_adv, role)
            else:
                assert self.spec is not None  # built-in models
                p_model, p_tr, p_row = self.fit(self.spec, ctx, ares.X_adv, role)
        elif config.protocol == "finetune":
            p_model, p_tr, p_row = self.finetune(self.saved[0], ares.X_adv, seed, role)
        else:
            p_model, p_tr, p_row = clean_model, clean_tr, clean_row
        # a token swap in a document changes its targets too (the next ids are the tokens)
        p_infl, p_abs, p_key, p_losses = self.influences(p_model, ares.X_adv, p_tr, role, ares.y_adv)
        if ares.loss_after is None and ares.loss_before is not None:  # a language model's, left to this pass
            ares = self.settle_attack_loss(ares, target, p_model, p_losses)
        self.rows["attacks"].append(
            {"seed": seed, "model": arch, **ares.to_dict(), "eps": eps_used, "perturbation_of_seed": first_seed}
        )
        if attack in TOKEN_ATTACKS:
            self.edits.append(
                {"seed": seed, "model": arch, "attack": attack, "eps": eps_used}
                | {"texts": token_edits(target, self.X_train, ares.X_adv)}
            )
        clean_infl, clean_abs, clean_key, _ = clean
        for damping, ci, pi, ca, pa in zip(config.damping, clean_infl, p_infl, clean_abs, p_abs):
            self.rows["runs"].append(
                {
                    "seed": seed,
                    "model": arch,
                    "attack": attack,
                    "eps": eps_used,
                    "damping": damping,
                    "damping_abs": pa,
                    "damping_abs_clean": ca,
                    **stability_by_k(ci, pi, config.top_ks),
                    "clean_model_accuracy_on_perturbed_train": clean_on_pert,
                    "clean_model_loss_on_perturbed_train": ares.loss_after,
                    **self.language_fields(ares, p_row),
                    "perturbation_norm_mean": ares.radius_mean,
                    "perturbation_linf_mean": ares.linf_mean,
                    "perturbation_linf_max": ares.linf_max,
                    "perturbation_l2_mean": ares.l2_mean,
                    "perturbation_l2_max": ares.l2_max,
                    "perturbed_test_accuracy": p_row["test_accuracy"],
                    "perturbed_train_loss": p_row["final_loss"] if config.protocol != "static" else None,
                    "clean_train_loss": clean_row["final_loss"],
                    "clean_test_accuracy": clean_row["test_accuracy"],
                    "inputs_sha256": pair_key(clean_key, p_key),
                }
            )
        if seed == config.seeds[0] and eps == config.eps[0]:
            self.examples.setdefault(arch, {})[attack] = (clean_infl[0], p_infl[0])

    def language_fields(self, ares, p_row: dict) -> dict:
        """A language model's stand-ins for the accuracies of a run row (none for a classifier):
        the clean model's loss and perplexity on the training documents before and after the
        attack, and the held-out loss and perplexity of the model of the perturbed data."""
        if self.config.loss != LM_LOSS:
            return {}
        return {
            "clean_model_loss_on_clean_train": ares.loss_before,
            "clean_model_perplexity_on_clean_train": ares.perplexity_before,
            "clean_model_perplexity_on_perturbed_train": ares.perplexity_after,
            "perturbed_test_loss": p_row.get("test_loss"),
            "perturbed_test_perplexity": p_row.get("test_perplexity"),
        }

    def perturbed(self, target: Any, attack_config: AttackConfig) -> tuple[Any, int, float | None]:
        """The training rows perturbed against ``target``, the seed whose attack computed them and
        ``target``'s accuracy on them: an attack that draws nothing from its seed (hotflip, fgsm,
        mim, pgd without a random start) on the same model and rows is computed once per run
        and reused by the later seeds."""
        key = None if attack_config.draws_randomness else attack_key(target, self.X_train, self.y_train, attack_config)
        earlier = self.state.attack_memo.get(key) if key is not None else None
        if earlier is not None:
            result, first_seed, on_perturbed = earlier
            return replace(result, config=attack_config), first_seed, on_perturbed
        t0 = time.perf_counter()
        result = perturb(
            target,
            self.X_train,
            self.y_train,
            attack_config,
            self.config.loss,
            before=self.saved_evaluation(target),
            after=not self.deferred_losses,
        )
        self.timings["attack"] += time.perf_counter() - t0
        # a language model has no accuracy (its loss on the perturbed documents is in the result)
        on_perturbed = None if self.config.loss == LM_LOSS else accuracy(logits_of(target, result.X_adv), self.y_train)
        if key is not None:
            self.state.attack_memo[key] = (result, self.seed, on_perturbed)
        return result, self.seed, on_perturbed

    @property
    def deferred_losses(self) -> bool:
        """Whether a language model's losses on the training documents, clean and perturbed, come
        from the influence runs on them (static protocol: the model that scores the documents is
        the saved one, the model each loss is of), not from forward passes of their own."""
        return self.config.loss == LM_LOSS and self.config.protocol == "static"

    def settle_saved_loss(self, model: Any, tr: TrainResult, row: dict, losses: torch.Tensor | None) -> None:
        """Fill in the saved model's loss and perplexity on the training documents, deferred by
        :meth:`given`: from ``losses`` (the clean influence run's, one per document) or, when the
        estimator ran no forward pass of its own, from a pass here. Shared by the seeds."""
        evaluation = self.state.saved_memo[self.arch][3]
        if evaluation["final_loss"] is None:
            if losses is not None:
                loss, ppl = documents_summary(losses, self.y_train)
                evaluation["train_loss_from"] = "the clean influence run's forward passes"
            else:
                loss, ppl = evaluate_documents(model, self.X_train, self.y_train, EVAL_ROWS)
                evaluation["train_loss_from"] = "a forward pass over the training documents"
            evaluation.update(final_loss=loss, train_perplexity=ppl)
        row.update({k: evaluation[k] for k in ("final_loss", "train_perplexity", "train_loss_from")})
        tr.final_loss, tr.loss_curve = evaluation["final_loss"], [evaluation["final_loss"]]

    def settle_attack_loss(self, ares: Any, target: Any, p_model: Any, losses: torch.Tensor | None) -> Any:
        """``ares`` with the attacked model's loss and perplexity on the perturbed documents, left
        to the influence run on them: its losses when that run scored them with ``target`` (the
        static protocol) and its estimator ran forward passes, else a forward pass here."""
        y_adv = self.y_train if ares.y_adv is None else ares.y_adv
        if losses is not None and p_model is target:
            after = documents_summary(losses, y_adv)
        else:
            after = evaluate_documents(target, ares.X_adv, y_adv, EVAL_ROWS)
        settled = replace(ares, loss_after=after[0], perplexity_after=after[1])
        for key, (result, first_seed, on_perturbed) in list(self.state.attack_memo.items()):
            if result.X_adv is ares.X_adv:  # later seeds reuse the settled result
                self.state.attack_memo[key] = (
                    replace(result, loss_after=after[0], perplexity_after=after[1]),
                    first_seed,
                    on_perturbed,
                )
        return settled

    def saved_evaluation(self, target: Any) -> tuple[float, float] | None:
        """A language model's (mean loss, perplexity) on the training documents when ``target`` is
        the saved model already evaluated on them (:meth:`given`), else None (measured by the attack)."""
        memo = self.state.saved_memo.get(self.arch)
        if self.config.loss != LM_LOSS or memo is None or memo[2] is not target or memo[1] is not self.X_train:
            return None
        return memo[3]["final_loss"], memo[3]["train_perplexity"]

    # ------------------------------------------------------------------ models
    def fit(self, spec, X_ctx, X, role: str, order_seed: int | None = None) -> tuple:
        """A built-in model of ``spec`` trained on (X, y_train) (data order ``order_seed``, default the cell's seed)."""
        config, seed = self.config, self.seed
        t0 = time.perf_counter()
        order_seed = seed if order_seed is None else order_seed
        gd = self.plan.train_configs[spec.arch]
        model, tr = train_builtin(config, spec, X_ctx, X, self.y_train, order_seed, f"{role}, seed {seed}", gd)
        self.timings["train"] += time.perf_counter() - t0
        with torch.no_grad():
            row = {
                "seed": seed,
                "model": spec.arch,
                "role": role,
                "final_loss": tr.final_loss,
                "steps_run": tr.steps_run,
                "reached_match_loss": tr.reached_tol,
                "train_accuracy": accuracy(model(X), self.y_train),
                "test_accuracy": accuracy(model(self.X_test), self.y_test),
                "optimizer": config.optimizer,
                "lr": config.lr_for(spec.arch),
                "batch_size": config.batch_size,
                "data_order_seed": None if config.optimizer == "gd" else order_seed,
                "match_loss": self.plan.targets[spec.arch],
                "loss_curve": sampled_curve(tr.loss_curve),
            }
        self.rows["training"].append(row)
        return model, tr, row

    def given(self, role: str) -> tuple:
        """A saved model as it is (the 'clean' model of ``static``): no training, its loss and
        accuracy recorded. Its working copy (the user's model stays as it is) and evaluation are
        made once per run and shared by the seeds."""
        assert self.fixed is not None  # called for saved models only
        saved = self.fixed[self.arch]
        memo = self.state.saved_memo.get(self.arch)
        if memo is None or memo[0] is not saved or memo[1] is not self.X_train:
            model = working_copy(saved, self.X_train.device, self.config.model_dtype)
            # static: a language model's training loss comes with the clean influence run (settle_saved_loss)
            evaluation = self.evaluated(model, self.X_train, self.config.loss, train=not self.deferred_losses)
            memo = (saved, self.X_train, model, evaluation)
            self.state.saved_memo[self.arch] = memo
        head = {"seed": self.seed, "model": self.arch, "role": role, "source": "saved model"}
        return self.recorded(memo[2], head, memo[3], {"steps_run": 0})

    def evaluated(self, model, X, loss: str, train: bool = True) -> dict:
        """``model``'s loss on (X, y_train), its training and test accuracies (a language model:
        its mean next-token loss and perplexity on the training and held-out documents, no
        accuracy; without ``train`` the training documents' are None, for :meth:`settle_saved_loss`)."""
        if loss == LM_LOSS:
            train_loss, train_ppl = evaluate_documents(model, X, self.y_train, EVAL_ROWS) if train else (None, None)
            test_loss, test_ppl = evaluate_documents(model, self.X_test, self.y_test, EVAL_ROWS)
            return {
                "final_loss": train_loss,
                "train_accuracy": None,
                "test_accuracy": None,
                "train_perplexity": train_ppl,
                "test_loss": test_loss,
                "test_perplexity": test_ppl,
            }
        out = logits_of(model, X)
        return {
            "final_loss": loss_value(out, self.y_train, loss).item(),
            "train_accuracy": accuracy(out, self.y_train),
            "test_accuracy": accuracy(logits_of(model, self.X_test), self.y_test),
        }

    def recorded(self, model, head: dict, evaluated: dict, after_loss: dict) -> tuple:
        """(model, TrainResult, row) of a saved model as it is or trained here from a recipe:
        its row of ``training`` (``head``, its loss and accuracies, ``after_loss``)."""
        row: dict[str, Any] = {
            **head,
            "final_loss": evaluated["final_loss"],
            **after_loss,
            "reached_match_loss": None,
            "train_accuracy": evaluated["train_accuracy"],
            "test_accuracy": evaluated["test_accuracy"],
            **{k: v for k, v in evaluated.items() if k in ("train_perplexity", "test_loss", "test_perplexity")},
        }
        self.rows["training"].append(row)
        final = row["final_loss"]
        tr = TrainResult(
            loss_curve=[final], steps_run=row["steps_run"], final_loss=final, reached_tol=None, diverged=False
        )
        return model, tr, row

    def finetune(self, base, X, order_seed: int, role: str) -> tuple:
        """A copy of the saved model ``base`` fine-tuned on (X, y_train) with the finetune recipe."""
        config = self.config
        t0 = time.perf_counter()
        model = working_copy(base, X.device, config.model_dtype, always=True)
        module = model.module if isinstance(model, Task) else model
        inputs = model.inputs if isinstance(model, Task) else None
        res = fit_recipe(module, X, self.y_train, config.finetune_recipe(order_seed), inputs=inputs)
        self.timings["train"] += time.perf_counter() - t0
        if res.diverged:
            raise FieldError(
                "finetune_lr",
                f"fine-tuning diverged for {self.arch} ({role}, seed {self.seed}) at " + "{name} "
                f"{config.finetune_lr:g}; lower it",
            )
        head = {"seed": self.seed, "model": self.arch, "role": role, "source": "fine-tuned saved model"}
        after_loss = {"steps_run": res.steps_run, "data_order_seed": order_seed}
        return self.recorded(model, head, self.evaluated(model, X, config.loss), after_loss)

    def refit(self, init_seed: int, order_seed: int, X_ctx, X, role: str) -> tuple:
        """A checkpoint's architecture rebuilt from ``init_seed`` and trained on (X, y_train)
        with its recorded recipe (data order from ``order_seed``)."""
        assert self.fixed is not None  # called for saved models only
        t0 = time.perf_counter()
        rb, template = self.state.rebuild[self.arch], self.fixed[self.arch]
        module = rb.build(init_seed, X_ctx)
        model = replace(template, module=module) if isinstance(template, Task) else module
        inputs = template.inputs if isinstance(template, Task) else None
        res = fit_recipe(module, X, self.y_train, replace(rb.recipe, seed=order_seed), inputs=inputs)
        self.timings["train"] += time.perf_counter() - t0
        if res.diverged:
            raise AuditError(f"retraining diverged for {self.arch} ({role}, seed {self.seed}) with the recorded recipe")
        head = {"seed": self.seed, "model": self.arch, "role": role, "source": "recorded recipe re-run"}
        loss = rb.recipe.loss  # the loss the recorded recipe trains with (the audit's loss may differ)
        after_loss = {"loss": loss, "steps_run": res.steps_run, "init_seed": init_seed, "data_order_seed": order_seed}
        return self.recorded(model, head, self.evaluated(model, X, loss), after_loss)

    # ------------------------------------------------------------------ influence
    def influences(self, model, X, tr: TrainResult, role: str, y=None) -> InfluenceRun:
        """The influence run of ``model`` on training rows ``X`` (:class:`InfluenceRun`; its key is
        None for TracIn, whose checkpoints come from training). ``y``: the training targets
        (default the cell's; a language model's swapped documents bring their own)."""
        config, state = self.config, self.state
        t0 = time.perf_counter()
        y = self.y_train if y is None else y
        rows = (X, y, self.X_test, self.y_test)
        key = None if config.estimator == "tracin" else influence_key(model, rows, config, state.n_classes, self.arch)
        earlier = state.influence_memo.get(key) if key is not None else None
        if earlier is not None:
            res, first = earlier
        else:
            res = self.sweep(model, X, tr, y)
            if key is not None:
                state.influence_memo[key] = (res, {"seed": self.seed, "role": role})
        self.timings["influence"] += time.perf_counter() - t0
        for r in res:
            for w in r.warnings:
                self.infl_warnings[w] = self.infl_warnings.get(w, 0) + 1
        seen = set()
        for r in res:
            if id(r) not in seen:
                row = diagnostics_row(self.seed, self.arch, role, r)
                if earlier is not None:  # bitwise the same inputs: the earlier result, not computed again
                    row.update(seconds=0.0, same_inputs_as=first)
                self.rows["diagnostics"].append(row)
                seen.add(id(r))
        return InfluenceRun(
            [r.total.detach().cpu().double().numpy() for r in res], [r.damping for r in res], key, res[0].train_losses
        )

    def sweep(self, model, X, tr: TrainResult, y) -> list:
        """One influence run over every damping (TracIn: at the training checkpoints, weighted)."""
        config = self.config
        weights = ckpts = None
        if config.estimator == "tracin":
            gd = self.plan.train_configs[self.arch]
            ckpts = tr.checkpoints
            assert gd.checkpoint_every is not None  # train_config sets it under tracin
            weights = tracin_weights(len(ckpts), gd.checkpoint_every, tr.steps_run, gd.lr)
        return influence_sweep(
            model,
            X,
            y,
            self.X_test,
            self.y_test,
            config.influence,
            loss=config.loss,
            n_classes=self.state.n_classes,
            dampings=config.damping,
            checkpoints=ckpts,
            checkpoint_weights=weights,
        )
