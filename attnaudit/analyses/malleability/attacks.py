"""Perturbations of the training data: FGSM, PGD, MIM, and the random-noise control.

Each adversarial method maximises the (trained, fixed) model's per-sample loss on every
training sample separately, inside the ball ||delta|| <= eps of the chosen norm, and keeps
x + delta inside the data's valid range [clip_min, clip_max]:

* ``fgsm`` (Goodfellow et al. 2015): one step of size eps along sign(g) (L-inf) or
  g / ||g||_2 (L2).
* ``pgd`` (Madry et al. 2018): random start inside the ball (uniform in the L-inf cube; for
  L2 uniform in the ball), then ``steps`` steps of size ``step_size`` (default 2.5 eps /
  steps), each followed by projection onto the ball and clipping to the valid range. The
  last iterate is returned.
* ``mim`` (Dong et al. 2018): momentum accumulator m <- mu m + g / ||g||_1, steps along
  sign(m) (L-inf) or m / ||m||_2 (L2), step size eps / steps by default; no random start.
* ``sign``: the default control -- the strongest random perturbation of the radius:
  +-eps on every coordinate (independent fair signs: a random corner of the L-inf cube),
  or for L2 a random sign vector scaled to L2 norm eps (a random direction on the
  sphere); then clipped. Same size as the adversarial attacks, random direction.
* ``random``: uniform noise in the L-inf cube (typical |delta_j| = eps/2, far below the
  corners the adversarial attacks reach), or uniform on the L2 sphere of radius eps;
  then clipped.
* ``none``: the data unchanged.

Clipping to the valid range moves each coordinate towards the clean value, so it never
leaves the ball; it does shrink the effective radius (most for noise on images with many
saturated pixels), which is why the result reports the perturbation norm actually used.

The model is any :class:`~attnaudit.core.task.Task` (or a bare module, wrapped in one):
input gradients come from the functional engine -- eval mode (no dropout, running
batch-norm statistics), the task's input and output adapters, the math kernel of scaled
dot-product attention, detached parameter copies -- so the model is never changed and
never put in training mode. The attack follows d l(x_i) / d x_i of the summed loss,
which is each row's own gradient because, in eval mode, rows are processed
independently (MLP-Attn's context is a fixed buffer during the attack). Token-id inputs
have no input gradient and are refused.

All randomness comes from a CPU ``torch.Generator`` seeded with ``seed``: deterministic
on any device. Memory: a few copies of X plus one chunk's forward/backward graph.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from attnaudit.core.engine import Engine
from attnaudit.core.task import Inputs, Loss, Task, as_task
from attnaudit.analyses.request import FieldError
from attnaudit.errors import AuditError
from attnaudit.core.training import accuracy
from attnaudit.analyses.malleability.attack_config import (  # noqa: F401  (re-exported: the runner's names)
    ATTACKS,
    SEEDLESS_ATTACKS,
    TOKEN_ATTACKS,
    ADVERSARIAL,
    RANDOM_CONTROLS,
    TOKEN_CONTROL,
    NORMS,
    AttackConfig,
    AttackResult,
    rows_in_budget,
)


def _norm_rows(delta: torch.Tensor, norm: str) -> torch.Tensor:
    flat = delta.reshape(delta.shape[0], -1)
    return flat.abs().amax(1) if norm == "linf" else flat.norm(dim=1)


def _unit(g: torch.Tensor, norm: str) -> torch.Tensor:
    """Steepest-ascent direction of unit ``norm``: sign(g) for L-inf, g / ||g||_2 for L2."""
    if norm == "linf":
        return g.sign()
    n = g.reshape(g.shape[0], -1).norm(dim=1).clamp_min(1e-300)
    return g / n.view(-1, *([1] * (g.ndim - 1)))


def _project(delta: torch.Tensor, eps: float, norm: str) -> torch.Tensor:
    if norm == "linf":
        return delta.clamp(-eps, eps)
    n = delta.reshape(delta.shape[0], -1).norm(dim=1)
    factor = torch.where(n > eps, eps / n.clamp_min(1e-300), torch.ones_like(n))
    return delta * factor.view(-1, *([1] * (delta.ndim - 1)))


def _clip(x: torch.Tensor, config: AttackConfig) -> torch.Tensor:
    if config.clip_min is None:
        return x
    return x.clamp(config.clip_min, config.clip_max)


def _noise(shape, eps: float, norm: str, ball: bool, gen: torch.Generator) -> torch.Tensor:
    """L-inf: uniform in the cube. L2: uniform on the sphere (``ball=False``) or in the ball."""
    if norm == "linf":
        return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * eps
    z = torch.randn(shape, generator=gen, dtype=torch.float64)
    z = z / z.reshape(shape[0], -1).norm(dim=1).clamp_min(1e-300).view(-1, *([1] * (len(shape) - 1)))
    if ball:
        dim = math.prod(shape[1:])
        r = torch.rand(shape[0], generator=gen, dtype=torch.float64) ** (1.0 / dim)
        z = z * r.view(-1, *([1] * (len(shape) - 1)))
    return z * eps


def _sign_noise(shape, eps: float, norm: str, gen: torch.Generator) -> torch.Tensor:
    """Independent fair signs: +-eps per coordinate (L-inf), or the sign vector scaled to L2 norm eps."""
    s = torch.randint(0, 2, shape, generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
    if norm == "linf":
        return s * eps
    return s * (eps / math.sqrt(math.prod(shape[1:])))


def _input_grad(engine: Engine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d l(x_i) / d x_i for every row, in x's dtype (the engine computes in its own)."""
    return _input_grad_and_logits(engine, x, y)[0]


def _input_grad_and_logits(engine: Engine, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g, logits = engine.input_grads_and_logits(engine.rows(x.detach()), engine.targets(y))
    return g.to(device=x.device, dtype=x.dtype), logits


def _attack_chunk(
    engine: Engine, x, y, config: AttackConfig, noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(perturbed rows, the clean rows' logits when the attack computed them anyway, else None)."""
    eps, norm, method = config.eps, config.norm, config.method
    if method == "none":
        return x.clone(), None
    if method in ("random", "sign"):
        return _clip(x + noise, config), None
    alpha = config.resolved_step_size
    assert alpha is not None  # every gradient attack (fgsm, pgd, mim) has a step size
    if method == "fgsm":
        g, clean_logits = _input_grad_and_logits(engine, x, y)
        if norm == "linf" and g is not x:  # g is ours: x + eps sign(g) built in its buffer (no allocation;
            x_adv = g.sign_().mul_(eps).add_(x)  # eps * (+-1) is exact, so the sum is x + eps sign(g) bit for bit)
        else:
            x_adv = torch.add(x, _unit(g, norm), alpha=eps)
        return (x_adv if config.clip_min is None else x_adv.clamp_(config.clip_min, config.clip_max)), clean_logits
    delta = torch.zeros_like(x)
    if method == "pgd" and config.random_start:
        delta = _clip(x + noise, config) - x
    momentum = torch.zeros_like(x)
    for _ in range(config.steps):
        g = _input_grad(engine, x + delta, y)
        if method == "mim":
            l1 = g.reshape(g.shape[0], -1).abs().sum(1).clamp_min(1e-300)
            momentum = config.momentum * momentum + g / l1.view(-1, *([1] * (g.ndim - 1)))
            g = momentum
        delta = _project(delta + alpha * _unit(g, norm), eps, norm)
        delta = _clip(x + delta, config) - x
    return x + delta, None


def attack_engine(
    model: Task | nn.Module, X: torch.Tensor, loss: str | Loss = "mse", dtype: torch.dtype | None = None
) -> Engine:
    """The engine an attack differentiates through: ``model`` as a Task (a bare module is
    wrapped with ``loss``, flat inputs and its logits' width as ``n_classes``).

    Attacks need no parameter derivatives, so the engine tracks only the smallest
    parameter (the others are shared, not copied). ``dtype``: computation dtype (default:
    the module's own). Build it once and pass it to :func:`perturb` for many attacks on the
    same model; rebuild it after changing the model's parameters (it holds a copy of one of
    them).
    """
    task = as_task(model, loss=loss, probe=X)
    named = list(task.module.named_parameters())
    if not named:
        raise AuditError("the model has no parameters; there is nothing to attack")
    smallest = min(named, key=lambda kv: kv[1].numel())[0]
    return Engine(task, dtype=dtype, names=[smallest])


_range_checked: tuple | None = None  # (weakref to the last tensor that passed, its version, range)


def _check_value_range(X: torch.Tensor, lo_valid: float, hi_valid: float) -> None:
    """Refuse data outside [lo_valid, hi_valid] (clipping to a range the data does not have
    would change it before any attack). One pass over X; a tensor that passed for this range
    is not read again while it is the same live object at the same version (in-place changes
    bump the version), as when one data set is attacked at many radii."""
    global _range_checked
    key = (X._version, lo_valid, hi_valid)
    last = _range_checked
    if last is not None and last[0]() is X and last[1:] == key:
        return
    lo, hi = (float(v) for v in torch.aminmax(X))
    slack = 1e-9 * max(1.0, abs(hi_valid - lo_valid))
    if lo < lo_valid - slack or hi > hi_valid + slack:
        raise AuditError(
            f"data values [{lo:.3g}, {hi:.3g}] lie outside the valid range [{lo_valid}, {hi_valid}]; "
            "give the range the data really has (preprocessed data has none: pass no range)"
        )
    _range_checked = (weakref.ref(X), *key)


def perturb(
    model: Task | nn.Module | Engine,
    X: torch.Tensor,
    y: torch.Tensor,
    config: AttackConfig,
    loss: str | Loss = "mse",
    *,
    dtype: torch.dtype | None = None,
    inputs: Inputs | None = None,
    evaluate: bool = True,
    before: tuple[float, float] | None = None,
    after: bool = True,
) -> AttackResult:
    """Perturb every row of X against ``model``, a Task or a module (left untouched, never
    put in training mode). A module is wrapped with ``loss`` and ``inputs`` (default flat
    rows); a Task uses its own. ``dtype``: the computation dtype (default: the module's);
    X_adv keeps X's dtype. ``model`` may also be an engine from :func:`attack_engine`, built
    once for many attacks on the same model (``loss``, ``dtype`` and ``inputs`` are then the
    engine's own). ``evaluate``: also measure the model's loss and accuracy before
    and after (one forward pass over X_adv, and one over X unless the attack's own gradient
    pass gave its logits, as FGSM's does) and the perturbation norms; without it those
    fields are None and only X_adv is computed. ``before``: a language model's (mean loss,
    perplexity) on (X, y) when the caller has measured them already (not measured again);
    ``after=False``: a language model's loss and perplexity after the attack are left None for
    the caller, who has a forward pass over the perturbed documents anyway (the static protocol's
    influence run on them)."""
    if X.ndim < 2 or X.shape[0] != y.shape[0]:
        raise AuditError("attack needs inputs (n, ...) and one label per row")
    from attnaudit.analyses.malleability.lm_attacks import is_language_model, perturb_documents

    task_of = model.task if isinstance(model, Engine) else model
    if is_language_model(task_of):  # documents: targets follow the tokens
        task = task_of if isinstance(task_of, Task) else as_task(task_of, loss=loss, probe=X)
        return perturb_documents(task, X, y, config, evaluate, before, after)
    if isinstance(model, Engine):
        engine = model
    else:
        if not isinstance(model, Task) and inputs is not None:
            model = as_task(model, loss=loss, inputs=inputs, probe=X)
        engine = attack_engine(model, X, loss, dtype)
    text_embeddings = _shift_module(engine) is not None
    if config.clip_min is not None and config.clip_max is not None and not text_embeddings:  # both or neither
        _check_value_range(X, config.clip_min, config.clip_max)
    if config.method in TOKEN_ATTACKS:
        return _perturb_tokens(engine, X, y, config, evaluate)
    if text_embeddings:
        return _perturb_text_embeddings(engine, X, y, config, evaluate)
    if config.method in ADVERSARIAL and not engine.inputs.differentiable:
        raise AuditError(
            "the model takes token ids, which have no input gradient; audit a Hugging Face text classifier (its "
            "embeddings are attacked) or use the hotflip attack (gradient-guided token swaps) with swap, or none"
        )
    gen = torch.Generator().manual_seed(int(config.seed))
    need_noise = config.method == "random" or (config.method == "pgd" and config.random_start)
    # One draw for the whole set (not per chunk), so the result does not depend on chunk_size.
    noise = (
        _noise(tuple(X.shape), config.eps, config.norm, config.method == "pgd", gen).to(X.device, X.dtype)
        if need_noise
        else None
    )
    if config.method == "sign":
        noise = _sign_noise(tuple(X.shape), config.eps, config.norm, gen).to(X.device, X.dtype)
    parts, clean = [], []
    chunk = config.rows_per_chunk(engine, X)
    for a in range(0, X.shape[0], chunk):
        b = min(X.shape[0], a + chunk)
        x_adv, logits = _attack_chunk(engine, X[a:b], y[a:b], config, None if noise is None else noise[a:b])
        parts.append(x_adv.detach())
        clean.append(logits)
    X_adv = parts[0] if len(parts) == 1 else torch.cat(parts)
    evaluated: dict[str, Any] = dict.fromkeys(("loss_before", "loss_after", "accuracy_before", "accuracy_after"))
    if evaluate:
        clean_logits = [c for c in clean if c is not None]
        if len(clean_logits) < len(clean):
            out_clean = engine.logits(engine.rows(X), chunk=chunk)
        else:
            out_clean = torch.cat(clean_logits)
        out_adv = engine.logits(engine.rows(X_adv), chunk=chunk)
        T = engine.targets(y)
        with torch.no_grad():
            evaluated = {
                "loss_before": float(engine.loss.per_sample(out_clean, T).mean()),
                "loss_after": float(engine.loss.per_sample(out_adv, T).mean()),
                "accuracy_before": accuracy(out_clean, y),
                "accuracy_after": accuracy(out_adv, y),
            }
    if not evaluate:
        return AttackResult(X_adv=X_adv, config=config, **evaluated, chunk_rows=chunk)
    with torch.no_grad():
        delta = X_adv - X
        linf, l2 = _norm_rows(delta, "linf"), _norm_rows(delta, "l2")
        radius = linf if config.norm == "linf" else l2  # the attack's own norm, one of the two

        def stat(v: torch.Tensor, how: str) -> float:
            return float(getattr(v, how)()) if v.numel() else 0.0

        return AttackResult(
            X_adv=X_adv,
            config=config,
            **evaluated,
            radius_mean=float(radius.mean()) if radius.numel() else 0.0,
            radius_max=float(radius.max()) if radius.numel() else 0.0,
            linf_mean=stat(linf, "mean"),
            linf_max=stat(linf, "max"),
            l2_mean=stat(l2, "mean"),
            l2_max=stat(l2, "max"),
            chunk_rows=chunk,
        )


#: hotflip on text sorted by length: texts attacked at once (each chunk at its longest text)
HOTFLIP_TEXT_ROWS = 32


def _perturb_tokens(
    engine: Engine, X: torch.Tensor, y: torch.Tensor, config: AttackConfig, evaluate: bool
) -> AttackResult:
    """``hotflip`` / ``swap`` on rows of token ids (:mod:`.token_attacks`): at most ``eps`` tokens
    per text; padding and the special tokens every row starts and ends with are never changed."""
    from attnaudit.analyses.malleability.token_attacks import (
        TokenAttackConfig,
        hf_embedding_model,
        hotflip,
        hotflip_bytes_per_row,
        protected_ids,
        random_swaps,
    )
    from attnaudit.models.hf import embedding_shift_rows

    shift = _shift_module(engine)
    if engine.inputs.kind != "tokens" and shift is None:
        raise AuditError(
            f"the {config.method} attack swaps tokens of text; this model takes {engine.inputs.kind} inputs"
        )
    if config.eps != round(config.eps) or config.eps < 1:
        raise FieldError(
            "eps",
            f"with the {config.method} attack, " + "{name} is the number of tokens swapped per text: give an "
            f"integer >= 1, got {config.eps:g}",
        )
    module = engine.task.module
    if not hasattr(module, "pad_token_id") or not hasattr(module, "model"):
        raise AuditError(f"the {config.method} attack needs a Hugging Face sequence classifier (its input embeddings)")
    pad: int | None = getattr(module, "pad_token_id", None)
    hf_model: nn.Module = getattr(module, "model")  # noqa: B009 - an nn.Module attribute mypy cannot see
    ids = shift.split_rows(X)[0] if shift is not None else X.long()
    cfg = TokenAttackConfig(budget=int(round(config.eps)), protected=protected_ids(ids, pad))
    logits_of, E = hf_embedding_model(hf_model, pad, trim_padding=bool(getattr(module, "trim_padding", False)))
    chunk = None
    if config.method == "hotflip":
        # a model that drops trailing padding attacks neighbours in length together
        order = engine.length_order(engine.rows(X))
        if config.memory_mb is not None and ids.shape[0] > 1:
            longest = engine.longest_first(engine.rows(X))  # probed on the longest texts
            per_row = hotflip_bytes_per_row(logits_of, E, ids[longest], y[longest], hf_model.parameters())
            chunk = rows_in_budget(ids.shape[0], config.memory_mb, per_row)
        if order is not None:
            chunk = min(chunk or ids.shape[0], HOTFLIP_TEXT_ROWS)
        result = hotflip(logits_of, E, ids, y, cfg, rows_per_chunk=chunk, order=order)
    else:
        result = random_swaps(ids, int(E.shape[0]), cfg, torch.Generator().manual_seed(int(config.seed)))
    if shift is not None:  # the swapped ids, unshifted embeddings
        X_adv = embedding_shift_rows(result.ids, shift.hidden).to(X.dtype).reshape(X.shape)
        changed = (result.ids != ids).sum(1).double()
    else:
        X_adv = result.ids.to(X.dtype)
        changed = (X_adv != X).sum(1).double()
    if not evaluate:
        return AttackResult(
            X_adv=X_adv,
            config=config,
            loss_before=None,
            loss_after=None,
            accuracy_before=None,
            accuracy_after=None,
            chunk_rows=chunk,
        )
    # perturbation size: tokens swapped per text
    return _text_attack_result(
        engine,
        X,
        X_adv,
        y,
        config,
        radius_mean=float(changed.mean()),
        radius_max=float(changed.max()),
        chunk_rows=chunk,
    )


def _text_attack_result(engine: Engine, X, X_adv, y, config: AttackConfig, **sizes: Any) -> AttackResult:
    """An attack on text with the model's loss and accuracy before and after (texts in chunks of 64) and ``sizes``."""
    T = engine.targets(y)
    with torch.no_grad():
        out_clean = engine.logits(engine.rows(X), chunk=min(config.chunk_size, 64))
        out_adv = engine.logits(engine.rows(X_adv), chunk=min(config.chunk_size, 64))
        return AttackResult(
            X_adv=X_adv,
            config=config,
            loss_before=float(engine.loss.per_sample(out_clean, T).mean()),
            loss_after=float(engine.loss.per_sample(out_adv, T).mean()),
            accuracy_before=accuracy(out_clean, y),
            accuracy_after=accuracy(out_adv, y),
            **sizes,
        )


def _shift_module(engine: Engine):
    """The model's :class:`~attnaudit.models.hf.HFEmbeddingShiftClassifier` (rows are ids plus embedding shifts), else None."""
    from attnaudit.models.hf import HFEmbeddingShiftClassifier

    module = engine.task.module
    return module if isinstance(module, HFEmbeddingShiftClassifier) else None


def _perturb_text_embeddings(
    engine: Engine, X: torch.Tensor, y: torch.Tensor, config: AttackConfig, evaluate: bool
) -> AttackResult:
    """FGSM / PGD / MIM / sign / random / none on the input embeddings of a text model
    (:mod:`.embedding_attacks`): ``eps`` is relative to each token's embedding norm."""
    from attnaudit.analyses.malleability.embedding_attacks import EMBEDDING_ATTACKS, perturb_embeddings

    if config.method not in EMBEDDING_ATTACKS:
        raise AuditError(
            f"the {config.method} attack does not apply to text embeddings; use fgsm, pgd, mim, sign or random"
        )
    if config.clip_min is not None:
        raise AuditError("text embeddings have no valid value range; give no clip_min/clip_max for a text model")
    outcome = perturb_embeddings(engine.task, X, y, **config.embedding_settings())
    X_adv = outcome.rows
    if not evaluate:
        return AttackResult(
            X_adv=X_adv, config=config, loss_before=None, loss_after=None, accuracy_before=None, accuracy_after=None
        )
    with torch.no_grad():
        hidden = int(getattr(engine.task.module, "hidden"))  # noqa: B009 - the shift classifier's width
        delta = (X_adv - X).reshape(X.shape[0], -1, hidden + 1)[..., 1:].reshape(X.shape[0], -1)
        linf, l2 = delta.abs().amax(1), delta.norm(dim=1)
    rel = outcome.relative_radius  # relative to the embedding norms, in the attack's norm
    return _text_attack_result(
        engine,
        X,
        X_adv,
        y,
        config,
        radius_mean=float(rel.mean()),
        radius_max=float(rel.max()),
        linf_mean=float(linf.mean()),
        linf_max=float(linf.max()),
        l2_mean=float(l2.mean()),
        l2_max=float(l2.max()),
    )


def config_dict(config: AttackConfig) -> dict:
    """The attack's settings as a JSON-safe dict."""
    return asdict(config)
