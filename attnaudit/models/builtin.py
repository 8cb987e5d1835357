"""Reference models: 2L-ReLU and MLP-Attn, with safetensors checkpoints.

Both are two-layer ReLU networks without biases, one output per class:

* NTK parametrization (default):      f(x) = a^T relu(W x / sqrt(d)) / sqrt(m),
  with W_ij, a_jk ~ N(0, 1);
* standard parametrization:            f(x) = a^T relu(W x),
  with W_ij ~ N(0, 1/d), a_jk ~ N(0, 1/m).

The two give the same function at initialisation; they differ in how gradient descent
scales with width. ``W`` has shape (m, d) and ``a`` shape (m, c).

``attn`` (MLP-Attn) first applies the parameter-free linearized attention map
f_att(x) = s * (X^T X) x, with the training set X as context (d x d, a buffer saved with
the model), then the same MLP. The raw scale of X^T X is huge (its top eigenvalue grows
like n * ||x||^2), so the context is multiplied by one global scalar s (a linear map stays
linear, so kappa amplification is untouched):

* ``rms`` (default): s makes the RMS row norm of f_att(X) equal that of X, so the MLP sees
  inputs of the same overall size for both models;
* ``spectral``: s = 1 / lambda_max(X^T X), so ||f_att(x)|| <= ||x||;
* ``none``: s = 1 (the literal definition; training is then badly scaled).

``init='antisymmetric'`` doubles the network: neurons m/2..m-1 copy the input weights of
neurons 0..m/2-1 with negated output weights, so f_0(x) = 0 exactly for every x.

The built-in transformers (``vit``, ``vit-linear``) live in :mod:`attnaudit.models.vit`;
:func:`build_builtin` builds any of the four built-in architectures from a data set's
feature shape, and :func:`save_model` / :func:`load_model` give them one checkpoint
format: ``model.safetensors`` (the weights) plus the side-car ``model.safetensors.json``::

    {"schema": "attnaudit.model/2", "arch": "vit",
     "spec": {...the ModelSpec or ViTSpec fields...}, "dtype": "float32",
     "input": {"kind": "images", "shape": [1, 28, 28]},    # 2-layer nets: {"kind": "flat", "shape": [d]}
     "metadata": {...training data, recipe, metrics...}}

Side-cars of the older schema ``attnaudit.model/1`` (2-layer nets only, no ``arch`` or
``input`` field) are still read.
"""

from __future__ import annotations

from attnaudit.errors import is_int

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from attnaudit.runtime.atomic import StagedFiles
from attnaudit.core.task import Inputs
from attnaudit.errors import AuditError, FieldError, clip_text, literal, show_value
from attnaudit.models.vit import VIT_ARCHITECTURES, ViT, ViTSpec
from attnaudit.models.weights import match_state_dict
from attnaudit.models.weights import load_into

ARCHITECTURES = ("relu", "attn")  # the 2-layer reference nets (ModelSpec)
BUILTIN_ARCHITECTURES = ARCHITECTURES + VIT_ARCHITECTURES
PARAMETRIZATIONS = ("ntk", "standard")
INITS = ("standard", "antisymmetric")
ATTN_SCALINGS = ("rms", "spectral", "none")
SIDECAR_SCHEMA = "attnaudit.model/2"
LEGACY_SIDECAR_SCHEMA = "attnaudit.model/1"  # 2-layer nets only; still read
_SIDECAR_FIELDS = ("schema", "arch", "spec", "dtype", "input", "metadata")
MAX_SIDECAR_BYTES = 1_000_000  # a genuine side-car is a few kB; refuse to read anything this large
_WEIGHT_DTYPES = (torch.float32, torch.float64)
# The range torch.Generator.manual_seed accepts.
_TORCH_SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to rebuild a reference model (the JSON side-car)."""

    arch: Literal["relu", "attn"]
    d_in: int
    width: int
    n_out: int
    parametrization: Literal["ntk", "standard"] = "ntk"
    init: Literal["standard", "antisymmetric"] = "standard"
    attn_scaling: Literal["rms", "spectral", "none"] = "rms"
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, allowed, what in (
            ("arch", ARCHITECTURES, "model"),
            ("parametrization", PARAMETRIZATIONS, "parametrization"),
            ("init", INITS, "init"),
            ("attn_scaling", ATTN_SCALINGS, "attention scaling"),
        ):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:
                raise AuditError(f"unknown {what} {show_value(value)}; use one of {', '.join(allowed)}")
        for name in ("d_in", "width", "n_out", "seed"):
            value = getattr(self, name)
            if not is_int(value):
                raise AuditError(f"model {name} must be an integer, got {show_value(value)} ({type(value).__name__})")
            object.__setattr__(self, name, int(value))  # numpy ints would not survive json.dumps
        if self.width < 1 or self.d_in < 1 or self.n_out < 1:
            raise AuditError(
                f"model sizes must be positive (width, input dimension, outputs), got width {clip_text(self.width, 60)}, "
                f"d_in {clip_text(self.d_in, 60)}, n_out {clip_text(self.n_out, 60)}"
            )
        lo, hi = _TORCH_SEED_RANGE
        if not lo <= self.seed <= hi:
            raise AuditError(f"model seed must be an integer in {lo}..{hi}, got {clip_text(self.seed, 60)}")
        if not isinstance(self.extra, dict):
            raise AuditError(f"model extra must be a dict, got {type(self.extra).__name__}")
        if self.init == "antisymmetric" and self.width % 2:
            raise AuditError(f"antisymmetric init needs an even width, got {self.width}; pass an even width")


def attention_context(X: torch.Tensor, scaling: str = "rms") -> torch.Tensor:
    """Scaled linearized-attention context s * X^T X (d x d) for training inputs X (n x d).

    f_att(x) = context @ x, and for the training rows f_att(X) = s * X X^T X = s * G X.
    """
    if scaling not in ATTN_SCALINGS:
        raise AuditError(f"unknown attention scaling {scaling!r}; use one of {', '.join(ATTN_SCALINGS)}")
    X64 = X.to(torch.float64)
    C = X64.T @ X64
    if scaling == "none":
        scale = 1.0
    elif scaling == "spectral":
        top = torch.linalg.eigvalsh(C)[-1].item()
        scale = 1.0 / top if top > 0 else 1.0
    else:  # rms
        transformed = X64 @ C  # rows are (C x_i)^T since C is symmetric
        raw_rms = X64.pow(2).sum(1).mean().sqrt().item()
        att_rms = transformed.pow(2).sum(1).mean().sqrt().item()
        scale = raw_rms / att_rms if att_rms > 0 else 1.0
    return (C * scale).to(X.dtype)


class TwoLayerNet(nn.Module):
    """2L-ReLU (``arch='relu'``) or MLP-Attn (``arch='attn'``); see the module docstring."""

    def __init__(self, spec: ModelSpec, context: torch.Tensor | None = None, dtype=torch.float64):
        super().__init__()
        self.spec = spec
        m, d, c = spec.width, spec.d_in, spec.n_out
        self.W = nn.Parameter(torch.empty(m, d, dtype=dtype))
        self.a = nn.Parameter(torch.empty(m, c, dtype=dtype))
        if spec.arch == "attn":
            if context is None:
                raise AuditError("MLP-Attn needs its attention context (the training inputs X); none was given")
            if tuple(context.shape) != (d, d):
                raise AuditError(f"attention context has shape {tuple(context.shape)}, expected ({d}, {d})")
            self.register_buffer("context", context.detach().to(dtype).clone())
        else:
            self.context = None
        self.reset_parameters(spec.seed)

    @property
    def width(self) -> int:
        return self.spec.width

    def head_parameter_names(self) -> list[str]:
        """The layer that produces the logits: the output weights ``a`` (the nets have no biases)."""
        return ["a"]

    def closed_form_blocker(self, inputs: Inputs) -> str | None:
        """Why the 2-layer closed forms cannot stand in for this module (None when they can):
        the fast path declares itself here, so the core need not know this class."""
        return two_layer_fast_path_blocker(self, inputs)

    def audit_inputs(self) -> Inputs:
        """How the data layer's rows reach this model: flat rows, as they are."""
        return Inputs()

    def reset_parameters(self, seed: int) -> None:
        """Deterministic Gaussian initialisation from ``seed`` (CPU generator, any device)."""
        m, d, c = self.spec.width, self.spec.d_in, self.spec.n_out
        gen = torch.Generator().manual_seed(int(seed))
        half = m // 2 if self.spec.init == "antisymmetric" else m
        W = torch.randn(half, d, generator=gen, dtype=torch.float64)
        a = torch.randn(half, c, generator=gen, dtype=torch.float64)
        if self.spec.init == "antisymmetric":
            W = torch.cat([W, W], 0)
            a = torch.cat([a, -a], 0)
        if self.spec.parametrization == "standard":
            W = W / math.sqrt(d)
            a = a / math.sqrt(m)
        with torch.no_grad():
            self.W.copy_(W.to(self.W.dtype))
            self.a.copy_(a.to(self.a.dtype))

    def features_in(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP's input: x itself (relu) or f_att(x) = context @ x (attn), rows as samples."""
        if self.context is not None:
            return x @ self.context  # context is symmetric, so this is (context @ x_i)^T per row
        return x

    def preactivation_scale(self) -> tuple[float, float]:
        """(input scale, output scale): 1/sqrt(d), 1/sqrt(m) under NTK, (1, 1) under standard."""
        if self.spec.parametrization == "ntk":
            return 1.0 / math.sqrt(self.spec.d_in), 1.0 / math.sqrt(self.spec.width)
        return 1.0, 1.0

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden activations relu(W z / sqrt(d)) for z = features_in(x), shape (n, m)."""
        s_in, _ = self.preactivation_scale()
        return torch.relu(self.features_in(x) @ self.W.T * s_in)

    def mlp(self, z: torch.Tensor) -> torch.Tensor:
        """The two-layer MLP on inputs that already went through :meth:`features_in`."""
        s_in, s_out = self.preactivation_scale()
        return torch.relu(z @ self.W.T * s_in) @ self.a * s_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.features_in(x))


_FORWARD_METHODS = ("forward", "mlp", "hidden", "features_in", "preactivation_scale")


def two_layer_fast_path_blocker(module: nn.Module, inputs) -> str | None:
    """Why a 2-layer closed form cannot stand in for ``module`` (None when it can).

    The closed forms (structured landscape evaluation, closed-form eNTK) apply to a
    :class:`TwoLayerNet` that keeps TwoLayerNet's own forward computation, fed flat rows
    positionally (``inputs``: an :class:`attnaudit.core.task.Inputs`).
    """
    if not isinstance(module, TwoLayerNet):
        return f"the model is a {type(module).__name__}, not a TwoLayerNet"
    cls = type(module)
    if not all(getattr(cls, f) is getattr(TwoLayerNet, f) for f in _FORWARD_METHODS):
        return f"{cls.__name__} overrides TwoLayerNet's forward computation"
    if inputs.kind != "flat" or inputs.keyword:
        return "the inputs are not flat rows passed positionally"
    return None


def build_model(spec: ModelSpec, X_train: torch.Tensor | None = None, dtype=torch.float64, device=None) -> TwoLayerNet:
    """Build a reference model; ``attn`` takes its context from ``X_train``."""
    context = None
    if spec.arch == "attn":
        if X_train is None:
            raise AuditError("MLP-Attn needs the training inputs to build its attention context")
        context = attention_context(X_train.to(torch.float64), spec.attn_scaling)
    model = TwoLayerNet(spec, context=context, dtype=dtype)
    if device is not None:
        model = model.to(device)
    return model


def image_shape_of(feature_shape, arch: str = "vit") -> tuple[int, int, int]:
    """(C, H, W) of a data set's ``feature_shape``: (C, H, W) as is, (H, W) as one channel
    (grayscale images stored without a channel axis, as ``digits``); flat rows are refused."""
    shape = tuple(int(s) for s in feature_shape)
    if len(shape) == 3:
        return shape  # type: ignore[return-value]
    if len(shape) == 2:
        return (1, *shape)  # type: ignore[return-value]
    features = math.prod(shape) if shape else 0
    raise FieldError(
        "arch",
        "{name} " + literal(arch) + f" needs image data (samples of shape (C, H, W)), but the data set has flat rows "
        f"of {features} features; use {{name}} relu or attn, or give image data (mnist, cifar10, digits or an image folder)",
    )


def build_builtin(
    arch: str,
    *,
    n_out: int,
    feature_shape,
    X_train: torch.Tensor | None = None,
    seed: int = 0,
    width: int = 64,
    depth: int = 2,
    dim: int = 64,
    heads: int = 4,
    patch: int = 7,
    mlp_ratio: int = 2,
    dtype: torch.dtype | None = None,
    device=None,
) -> nn.Module:
    """Any built-in architecture (``relu``, ``attn``, ``vit``, ``vit-linear``) for a data set.

    ``feature_shape``: the data set's sample shape ((C, H, W) or (H, W) for images, (d,)
    for flat rows). The 2-layer nets take ``width`` and flat rows of prod(feature_shape)
    features; ``attn`` builds its context from ``X_train`` (required). The ViTs take
    ``depth``, ``dim``, ``heads``, ``patch``, ``mlp_ratio`` and need image data. ``dtype``:
    default float64 for the 2-layer nets (the NTK comparisons need it), float32 for ViTs.
    """
    if not isinstance(arch, str) or arch not in BUILTIN_ARCHITECTURES:
        raise FieldError(
            "arch", "unknown {name} " + literal(show_value(arch)) + f"; use one of {', '.join(BUILTIN_ARCHITECTURES)}"
        )
    if arch in VIT_ARCHITECTURES:
        spec = ViTSpec(
            arch,  # type: ignore[arg-type]  # one of VIT_ARCHITECTURES, checked above
            image_shape_of(feature_shape, arch),
            n_out,
            depth=depth,
            dim=dim,
            heads=heads,
            patch=patch,
            mlp_ratio=mlp_ratio,
            seed=seed,
        )
        return ViT(spec, dtype=dtype or torch.float32, device=device)
    d_in = math.prod(int(s) for s in feature_shape)
    if arch == "attn" and X_train is None:
        raise FieldError("arch", "{name} attn needs the training inputs to build its attention context")
    return build_model(
        # arch is one of ARCHITECTURES here (checked above)
        ModelSpec(arch, d_in, width, n_out, seed=seed),  # type: ignore[arg-type]
        X_train,
        dtype=dtype or torch.float64,
        device=device,
    )


def training_data_mismatch(model: nn.Module, label: str, fingerprint: str) -> str | None:
    """A warning when a saved model's side-car records different training data than ``fingerprint``.

    Models saved by attnaudit carry ``metadata.training_data.fingerprint``
    (:func:`attnaudit.data.data_fingerprint`); older or foreign side-cars carry none, and
    then nothing can be said.
    """
    recorded = (getattr(model, "metadata", None) or {}).get("training_data") or {}
    saved = recorded.get("fingerprint")
    if not saved or saved == fingerprint:
        return None
    where = ", ".join(f"{k} {recorded[k]}" for k in ("name", "split", "n") if recorded.get(k) is not None)
    return (
        f"saved model {label} was trained on other data ({where}; fingerprint {saved}) than the data audited now "
        f"(fingerprint {fingerprint}): the numbers describe the model away from its training set; audit it on "
        f"the data it was trained on to measure its own minimum and influence"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _input_record(model: TwoLayerNet | ViT) -> dict:
    """The side-car's ``input``: how data rows reach the model."""
    if isinstance(model, ViT):
        return {"kind": "images", "shape": list(model.spec.image_shape)}
    return {"kind": "flat", "shape": [model.spec.d_in]}


def save_model(
    model: TwoLayerNet | ViT, path: str | Path, overwrite: bool = False, metadata: dict | None = None
) -> Path:
    """Write ``path`` (.safetensors) and ``path`` + ``.json`` side-car; refuse to overwrite unless asked.

    ``model``: a built-in :class:`TwoLayerNet` or :class:`~attnaudit.models.vit.ViT` with float32
    or float64 weights. The side-car follows the ``attnaudit.model/2`` schema (module
    docstring); ``metadata`` must be JSON-serialisable.

    Both files are first written to temporary names in the same folder and only then
    renamed into place (side-car first), so an interrupted save leaves the old files (or
    none) rather than a truncated checkpoint, and the weights never appear without their
    side-car.
    """
    from safetensors.torch import save_file

    if not isinstance(model, (TwoLayerNet, ViT)):
        raise AuditError(
            f"save_model writes attnaudit's built-in models (TwoLayerNet, ViT), not a {type(model).__name__}; save your "
            "own module's state_dict with safetensors.torch.save_file and audit it with --factory and --weights"
        )
    path = Path(path)
    sidecar = path.with_suffix(path.suffix + ".json")
    for target in (path, sidecar):
        if target.exists() and not overwrite:
            raise AuditError(f"{target} already exists; pass --overwrite or choose another path")
    if not path.parent.is_dir():
        raise AuditError(f"cannot save model {path}: folder {path.parent} does not exist; create it first")
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if v is not None}
    dtypes = sorted({_dtype_name(t.dtype) for t in tensors.values()})
    if len(dtypes) != 1 or dtypes[0] not in ("float32", "float64"):
        raise AuditError(
            f"cannot save model {path}: its tensors are {', '.join(dtypes)}; checkpoints hold float32 or float64 "
            "weights of one dtype (convert with model.float() or model.double())"
        )
    side = {
        "schema": SIDECAR_SCHEMA,
        "arch": model.spec.arch,
        "spec": asdict(model.spec),
        "dtype": dtypes[0],
        "input": _input_record(model),
        "metadata": dict(metadata or {}),
    }
    try:
        side_text = json.dumps(side, indent=2, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise AuditError(f"cannot save model {path}: its metadata is not JSON ({clip_text(exc, 120)})") from None
    try:
        with StagedFiles() as files:
            files.stage(sidecar, lambda p: Path(p).write_text(side_text, encoding="utf-8"))
            files.stage(path, lambda p: save_file(tensors, str(p)))
            files.commit()
    except OSError as exc:
        raise AuditError(
            f"cannot save model {path} ({type(exc).__name__}: {clip_text(exc, 200)}); check the folder is writable "
            "and has space"
        ) from None
    return path


def _bad_model(path: Path, problem: str) -> AuditError:
    return AuditError(f"cannot load model {path}: {problem}; re-save it with attnaudit")


def _sidecar_document(path: Path, sidecar: Path) -> dict:
    """The side-car as a JSON object (size, encoding and syntax checked); AuditError otherwise."""
    try:
        size = sidecar.stat().st_size
        if size > MAX_SIDECAR_BYTES:
            raise _bad_model(
                path,
                f"side-car {sidecar.name} is {size} bytes, far more than a side-car holds "
                f"(at most {MAX_SIDECAR_BYTES}); it is not an attnaudit side-car",
            )
        side = json.loads(sidecar.read_bytes().decode("utf-8"))
    except AuditError:
        raise
    except UnicodeDecodeError:
        raise _bad_model(path, f"side-car {sidecar.name} is not UTF-8 text") from None
    except (ValueError, RecursionError) as exc:
        raise _bad_model(path, f"side-car {sidecar.name} is not valid JSON ({clip_text(exc, 120)})") from None
    except OSError as exc:
        raise _bad_model(
            path, f"cannot read side-car {sidecar.name} ({type(exc).__name__}: {clip_text(exc, 120)})"
        ) from None
    if not isinstance(side, dict):
        raise _bad_model(path, f"side-car {sidecar.name} holds a JSON {type(side).__name__}, not an object")
    return side


def _typed_spec(path: Path, raw: object, cls: type, required: tuple[str, ...]):
    """``cls(**raw)`` (ModelSpec or ViTSpec) with unknown, missing and ill-typed fields as AuditErrors."""
    if not isinstance(raw, dict):
        raise _bad_model(path, f"side-car 'spec' must be an object, got {type(raw).__name__}")
    known = [f.name for f in fields(cls)]
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        raise _bad_model(path, f"side-car spec has unknown field(s) {clip_text(', '.join(unknown), 120)}")
    missing = [k for k in required if k not in raw]
    if missing:
        raise _bad_model(path, f"side-car spec lacks field(s) {', '.join(missing)}")
    try:
        return cls(**raw)
    except AuditError as exc:
        raise _bad_model(path, f"side-car spec is invalid ({exc})") from None


_REQUIRED = {ModelSpec: ("arch", "d_in", "width", "n_out"), ViTSpec: ("arch", "image_shape", "n_out")}


def _read_sidecar(path: Path, sidecar: Path) -> tuple[ModelSpec | ViTSpec, dict, str | None]:
    """The side-car's spec, metadata and recorded dtype, each checked; AuditError otherwise.

    Schema ``attnaudit.model/2`` (every built-in architecture) and the older
    ``attnaudit.model/1`` (2-layer nets: schema, spec, dtype, metadata) are read.
    """
    side = _sidecar_document(path, sidecar)
    schema = side.get("schema")
    if schema == LEGACY_SIDECAR_SCHEMA:
        raw = side.get("spec")
        if isinstance(raw, dict) and isinstance(raw.get("arch"), str) and raw["arch"] in VIT_ARCHITECTURES:
            raise _bad_model(
                path,
                f"side-car schema {LEGACY_SIDECAR_SCHEMA} holds only the 2-layer nets "
                f"({', '.join(ARCHITECTURES)}), but its spec's arch is {raw['arch']!r}",
            )
        spec = _typed_spec(path, side.get("spec"), ModelSpec, _REQUIRED[ModelSpec])
    elif schema == SIDECAR_SCHEMA:
        unknown = sorted(str(k) for k in side if k not in _SIDECAR_FIELDS)
        if unknown:
            raise _bad_model(
                path,
                f"side-car has unknown field(s) {clip_text(', '.join(unknown), 120)} "
                f"(an {SIDECAR_SCHEMA} side-car holds {', '.join(_SIDECAR_FIELDS)})",
            )
        arch = side.get("arch")
        if not isinstance(arch, str) or arch not in BUILTIN_ARCHITECTURES:
            raise _bad_model(
                path, f"side-car 'arch' is {show_value(arch)}; expected one of {', '.join(BUILTIN_ARCHITECTURES)}"
            )
        cls = ViTSpec if arch in VIT_ARCHITECTURES else ModelSpec
        spec = _typed_spec(path, side.get("spec"), cls, _REQUIRED[cls])
        if spec.arch != arch:
            raise _bad_model(path, f"side-car 'arch' is {arch!r} but its spec describes a {spec.arch!r} model")
        record = side.get("input")
        if record is not None:
            expected = (
                {"kind": "images", "shape": list(spec.image_shape)}
                if cls is ViTSpec
                else {"kind": "flat", "shape": [spec.d_in]}
            )
            if record != expected:
                raise _bad_model(
                    path,
                    f"side-car 'input' is {show_value(record, 100)} but its spec needs {show_value(expected, 100)}",
                )
    else:
        raise _bad_model(
            path,
            f"side-car schema is {show_value(schema)}, expected {SIDECAR_SCHEMA!r} (or the older {LEGACY_SIDECAR_SCHEMA!r})",
        )
    metadata = side.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise _bad_model(path, f"side-car 'metadata' must be an object, got {type(metadata).__name__}")
    dtype = side.get("dtype")
    if dtype is not None and dtype not in ("float32", "float64"):
        raise _bad_model(path, f"side-car dtype is {show_value(dtype)}; expected 'float32' or 'float64'")
    return spec, metadata, dtype


def _check_tensors(path: Path, spec: ModelSpec, tensors: dict, recorded_dtype: str | None) -> torch.dtype:
    """Names, dtypes, shapes and finiteness of the weights against the side-car's spec."""
    m, d, c = spec.width, spec.d_in, spec.n_out
    expected = {"W": (m, d), "a": (m, c)}
    if spec.arch == "attn":
        expected["context"] = (d, d)
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise _bad_model(
            path,
            f"the weights file has no tensor {', '.join(missing)} (a {spec.arch} model holds {', '.join(expected)})",
        )
    extra = sorted(k for k in tensors if k not in expected)
    if extra:
        raise _bad_model(
            path,
            f"the weights file holds unexpected tensor(s) {clip_text(', '.join(extra), 120)} "
            f"(a {spec.arch} model holds only {', '.join(expected)})",
        )
    for name in expected:
        if tensors[name].dtype not in _WEIGHT_DTYPES:
            raise _bad_model(
                path,
                f"tensor {name} has dtype {str(tensors[name].dtype).replace('torch.', '')}; "
                "expected float32 or float64",
            )
    dtype = tensors["W"].dtype
    for name in expected:
        if tensors[name].dtype != dtype:
            raise _bad_model(
                path,
                f"tensors W and {name} have different dtypes "
                f"({str(dtype).replace('torch.', '')} and {str(tensors[name].dtype).replace('torch.', '')})",
            )
    if recorded_dtype is not None and recorded_dtype != str(dtype).replace("torch.", ""):
        raise _bad_model(
            path, f"the side-car records dtype {recorded_dtype} but the tensors are {str(dtype).replace('torch.', '')}"
        )
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            raise _bad_model(
                path,
                f"tensor {name} has shape {got} but the side-car spec (width {clip_text(m, 60)}, "
                f"d_in {clip_text(d, 60)}, n_out {clip_text(c, 60)}) needs {show_value(shape, 120)}; the two files "
                "do not belong together",
            )
    for name in expected:
        if not bool(torch.isfinite(tensors[name]).all()):
            raise _bad_model(path, f"tensor {name} holds non-finite values (NaN or inf)")
    return dtype


_FIX = "the side-car and the weights do not belong together; re-save it with attnaudit"


def _check_vit_tensors(path: Path, spec: ViTSpec, tensors: dict, recorded_dtype: str | None) -> torch.dtype:
    """Names, shapes and finiteness (against a skeleton ViT on the meta device, so nothing is
    allocated for a spec that does not fit the file), then one float dtype."""

    match_state_dict(ViT(spec, device="meta"), tensors, where=f"cannot load model {path}", fix=_FIX)
    for name, t in tensors.items():
        if t.dtype not in _WEIGHT_DTYPES:
            raise _bad_model(path, f"tensor {name} has dtype {_dtype_name(t.dtype)}; expected float32 or float64")
    dtypes = sorted({_dtype_name(t.dtype) for t in tensors.values()})
    if len(dtypes) > 1:
        raise _bad_model(path, f"the tensors mix dtypes ({', '.join(dtypes)}); a checkpoint holds one")
    if recorded_dtype is not None and recorded_dtype != dtypes[0]:
        raise _bad_model(path, f"the side-car records dtype {recorded_dtype} but the tensors are {dtypes[0]}")
    return getattr(torch, dtypes[0])


def load_model(path: str | Path, device=None) -> TwoLayerNet | ViT:
    """Load a model written by :func:`save_model` (weights + side-car), checking both files.

    The side-car must be a JSON object with an attnaudit schema (``attnaudit.model/2``, or
    ``attnaudit.model/1`` for 2-layer nets) and a valid spec; the weights must be exactly
    the tensors that spec implies (2-layer: W, a, and context for attn; ViT: every
    parameter of :class:`~attnaudit.models.vit.ViT`), of the right shapes, one float dtype, and
    finite. Anything else raises AuditError. The model is built on the CPU in the file's
    dtype, gets ``.metadata`` (the side-car's metadata dict), and is moved to ``device``
    when given.
    """
    from safetensors.torch import load_file

    path = Path(path)
    sidecar = path.with_suffix(path.suffix + ".json")
    if not path.exists():
        raise AuditError(f"{path}: model file not found; check the path")
    if not sidecar.exists():
        raise AuditError(f"model side-car {sidecar} not found; save models with attnaudit so both files exist")
    spec, metadata, recorded_dtype = _read_sidecar(path, sidecar)
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - any parse failure is the user's file
        raise _bad_model(
            path,
            f"the weights are not a readable .safetensors file ({type(exc).__name__}: "
            f"{clip_text(' '.join(str(exc).split()), 160)})",
        ) from None
    model: TwoLayerNet | ViT
    if isinstance(spec, ViTSpec):
        dtype = _check_vit_tensors(path, spec, tensors, recorded_dtype)
        model = ViT(spec, dtype=dtype)
        load_into(model, tensors, where=f"cannot load model {path}", fix=_FIX)  # loads in place
    else:
        dtype = _check_tensors(path, spec, tensors, recorded_dtype)
        model = TwoLayerNet(spec, context=tensors.get("context"), dtype=dtype)
        model.load_state_dict(tensors)
    # a plain attribute; nn.Module types attributes it does not declare as Tensor | Module
    model.metadata = dict(metadata)  # type: ignore[assignment]
    if device is not None:
        model = model.to(device)
    return model
