"""Benchmark: the full audit of transformers at the size people train, time and peak memory per stage.

Two models, built offline from configs, trained briefly, then audited by all four analyses
through the library (the same requests as the command line):

* ``deit-tiny``: a DeiT-tiny-shaped ViT (12 blocks, width 192, 3 heads, patch 4) trained
  with ``attnaudit train``'s recipe on real MNIST (28 x 28; ../shared/data) or the embedded
  digits when MNIST is absent;
* ``bert-mini``: a BERT-mini-shaped encoder (4 layers, width 256, 4 heads, sequences padded
  to 128 tokens) trained on the generated review set of examples/text (templated sentences:
  no licence to track; reviews of 5 to 128 tokens, 67 on average) with
  :func:`attnaudit.core.fit.fit`; the network at initialization is saved first
  (``bert-init``), the reference of its kernel movement (a Hugging Face checkpoint records
  no training recipe, so its ntk-distance has no linearized comparator).

Each stage runs in its own process (its time includes the child's start-up, about 3 s of
importing torch and transformers), and the peak resident memory printed is the largest of
the children so far (``ru_maxrss``). A stage that fails (a memory planner's refusal) is
printed with the last line of its error and the later stages still run. Printed, one line
per stage, then per model:

    SCALE model=<name> params=<count> total_s=<seconds> audit_s=<seconds> peak_gb=<GiB> [gpu_peak_gb=<GiB>] [failed=<stages>]

``total_s`` counts every stage, training included; ``audit_s`` the four analyses only (the
audit of an already trained model, what the 15-minute target is about).

Under each stage, ``STAGE_TIMINGS`` (the analysis's own timings, what dominates inside it)
and ``STAGE_PLAN`` (the memory, chunk and pass choices its report records); each analysis's
report is kept as ``<model>-<stage>.json`` in the output folder. Then
``RATIO influence_over_gemm_floor=<x>``: the malleability stage's time over the time of
the per-sample-gradient GEMM floor it cannot beat (one (n_train x P) x (P x n_test)
product of the gradients it forms). ``--small`` shrinks everything for a quick check (the
test suite does not run this file; ``--small`` takes about a minute on 2 cores).

    python benchmarks/bench_scale.py [--small] [--threads N] [--out DIR] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# real data: ../shared/data beside the checkout, or a folder named by ATTNAUDIT_SHARED_DATA
# (the GPU machine receives the repository only, so the check carries MNIST in a folder of its own)
SHARED = Path(os.environ.get("ATTNAUDIT_SHARED_DATA") or ROOT.parent / "shared" / "data")

SIZES = {
    "full": {
        # DeiT-tiny's configuration (12 blocks, width 192, 3 heads, MLP ratio 4: 5.4 M parameters on
        # 28 x 28 images with patch 4) and BERT-mini's (4 layers, width 256, 4 heads, its 30,522-word
        # embedding table: 11.2 M parameters)
        "deit-tiny": dict(depth=12, dim=192, heads=3, patch=4, mlp_ratio=4, steps=300, n_train=2000, n=512),
        "bert-mini": dict(layers=4, width=256, heads=4, length=128, vocab=30522, steps=200, n_records=2000, n=256),
        # DistilBERT's configuration (6 layers, width 768, 12 heads, 30,522 words: 67 M parameters), its
        # malleability audit with the projected estimator over 2,000 training and 100 held-out texts
        "distilbert": dict(layers=6, width=768, heads=12, length=128, vocab=30522, steps=30, n_train=2000, n_test=100),
        # GPT-2 small's configuration (12 layers, width 768, 12 heads, 50,257 words: 124 M parameters) on
        # 512 training documents of 256 tokens
        "gpt2-small": dict(
            layers=12,
            width=768,
            heads=12,
            length=256,
            vocab=50257,
            steps=4,
            n_train=512,
            n_test=16,
            n_sub=16,
            n_kernel=8,
        ),
    },
    "small": {
        "deit-tiny": dict(depth=2, dim=48, heads=3, patch=7, mlp_ratio=2, steps=20, n_train=200, n=64),
        "bert-mini": dict(layers=1, width=64, heads=4, length=32, vocab=0, steps=20, n_records=200, n=32),
        "distilbert": dict(layers=1, width=64, heads=4, length=32, vocab=0, steps=5, n_train=60, n_test=10),
        "gpt2-small": dict(
            layers=1, width=32, heads=2, length=32, vocab=500, steps=2, n_train=40, n_test=8, n_sub=8, n_kernel=8
        ),
    },
}


# appended to every stage: the stage's peak GPU memory (torch's allocator), 0 without a GPU
GPU_PEAK = "\nimport torch\nprint('GPU_PEAK_GIB', torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0)\n"
# appended to every analysis stage (``r``, its result): the report is kept beside the
# checkpoints and the stage prints its own timings and what its memory planner chose
REPORT = """
import json
from pathlib import Path
Path({path!r}).write_text(json.dumps(r.report, default=str, indent=1), encoding="utf-8")
def plan(node, where=""):
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, (dict, list)):
                yield from plan(value, f"{{where}}.{{key}}" if where else key)
            elif any(w in key for w in ("memory", "chunk", "passes", "budget", "plan")) and "per_sample" not in where:
                yield f"{{where}}.{{key}}={{value}}" if where else f"{{key}}={{value}}"
    elif isinstance(node, list):
        for i, value in enumerate(node[:2]):
            yield from plan(value, f"{{where}}[{{i}}]")
def timings(node, where=""):
    if isinstance(node, dict):
        for key, value in node.items():
            if key.startswith("timings") and isinstance(value, dict):
                yield (f"{{where}}." if where else "") + key, {{k: round(float(v), 2) for k, v in value.items()}}
            elif isinstance(value, dict):
                yield from timings(value, f"{{where}}.{{key}}" if where else key)
print("STAGE_TIMINGS", json.dumps(dict(timings(r.report)), default=str))
print("STAGE_PLAN", "; ".join(list(dict.fromkeys(plan(r.report.get("results", {{}}))))[:12]))
"""


def _stage(code: str, env: dict, timeout: float | None = None) -> tuple[float, float, str, str | None]:
    """Run ``code`` in a child process: (seconds, peak GiB of the children so far, its stdout,
    None or the last line of its error output when it failed: a refusal by a memory planner is
    a result, so the later stages still run). A stage past ``timeout`` seconds is stopped and
    reported as timed out."""
    t0 = time.perf_counter()
    error = None
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False, timeout=timeout
        )
    except subprocess.TimeoutExpired as stopped:
        seconds = time.perf_counter() - t0
        stdout = stopped.stdout.decode() if isinstance(stopped.stdout, bytes) else (stopped.stdout or "")
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
        return seconds, peak, stdout, f"timed out after {seconds:.0f} s"
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
        error = lines[-1] if lines else f"exit status {out.returncode}"
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child so far
    return seconds, peak_kib / 2**20, out.stdout, error


def _data_args() -> dict:
    if (SHARED / "MNIST").is_dir():
        return {"dataset": "mnist", "split": "test", "data_dir": str(SHARED)}
    return {"dataset": "digits"}


def deit_stages(size: dict, work: Path, device: str = "cpu") -> list[tuple[str, str]]:
    ckpt = work / "deit.safetensors"
    data = _data_args()
    if data["dataset"] == "digits":  # 1,437 rows in the train split, 287 of them held out
        size = {**size, "n_train": min(size["n_train"], 1100)}
    common = f"import attnaudit as aa; data = {{**{data!r}, 'device': {device!r}}}\n"
    train = (
        common + f"aa.run(aa.TrainRequest(arch='vit', depth={size['depth']}, dim={size['dim']}, heads={size['heads']}, "
        f"patch={size['patch']}, mlp_ratio={size['mlp_ratio']}, steps={size['steps']}, n_train={size['n_train']}, "
        f"out_path={str(ckpt)!r}, **data))\n"
        f"from safetensors.torch import load_file; print(sum(t.numel() for t in load_file({str(ckpt)!r}).values()))"
    )
    ck = f"checkpoint=({str(ckpt)!r},)"
    return [
        ("train", train),
        ("kappa", common + f"r = aa.run(aa.KappaRequest({ck}, n=({size['n']},), **data))"),
        (
            "ntk-distance",
            common
            + f"r = aa.run(aa.NtkDistanceRequest({ck}, n_test={size['n']}, kernel_points={size['n'] // 4}, **data))",
        ),
        (
            "malleability",
            common + f"r = aa.run(aa.MalleabilityRequest({ck}, protocol='static', attacks=('pgd', 'sign'), "
            f"estimator='ekfac', n_train={size['n']}, n_test={size['n'] // 4}, seeds=2, **data))",
        ),
        (
            "landscape",
            common + f"r = aa.run(aa.LandscapeRequest({ck}, n_train={size['n']}, points=0, grid=0, eigenvalues=2, "
            "hutchinson_samples=4, basin_directions=1, **data))",
        ),
    ]


def text_build(
    size: dict,
    reviews: Path,
    folder: Path,
    n_records: int,
    config: str,
    model_class: str,
    device: str,
    lr: float,
    batch_size: int,
    init_copy: Path | None = None,
) -> str:
    """The script that writes ``n_records`` reviews (3 to length - 2 words: token sequences of 5
    to ``length``, so the sequence length is used; padding is left out of per-token analyses, not
    computed away) and the tokenizer, builds ``model_class`` from ``config`` (a Python expression;
    VOCAB: the configured vocabulary, at least the tokenizer's words; LABELS: the label names),
    saves it (and at ``init_copy`` its initialization), fine-tunes it with Adam for ``size['steps']``
    steps and prints its parameter count."""
    config = config.replace("VOCAB", f"max({size['vocab']}, 4 + len(POSITIVE + NEGATIVE + NOUNS + FILLER))").replace(
        "LABELS", 'label2id={"negative": 0, "positive": 1}, id2label={0: "negative", 1: "positive"}'
    )
    init = f"model.save_pretrained(Path({str(init_copy)!r}))\n" if init_copy is not None else ""
    return f"""
import sys, torch, transformers
sys.path.insert(0, {str(ROOT / "examples" / "text")!r})
from make_text_checkpoint import write_data, write_model, POSITIVE, NEGATIVE, NOUNS, FILLER
from pathlib import Path
write_data(Path({str(reviews)!r}), n={n_records}, phrases=(1, ({size["length"]} - 2) // 3))
folder = Path({str(folder)!r})
write_model(folder)  # the tokenizer; its model is replaced by the configured one
config = {config}
torch.manual_seed(0)
model = {model_class}(config).eval()
model.save_pretrained(folder)  # the configuration the data are cut to (its position limit)
{init}from attnaudit.data import DataSpec, load_dataset
from attnaudit.core.fit import Recipe, fit
from attnaudit.core.task import Inputs
from attnaudit.models.hf import HFSequenceClassifier
ds = load_dataset(DataSpec(data={str(reviews)!r}, tokenizer=str(folder), max_length={size["length"]}))
wrapped = HFSequenceClassifier(model, pad_token_id=0).to({device!r})
fit(wrapped, ds.X, ds.y, Recipe(optimizer="adam", lr={lr}, batch_size={batch_size}, steps={size["steps"]}, loss="ce"),
    inputs=Inputs(kind="tokens", keyword=None))
model.cpu().save_pretrained(folder)
print(sum(p.numel() for p in model.parameters()))
"""


def bert_stages(size: dict, work: Path, device: str = "cpu") -> list[tuple[str, str]]:
    folder, reviews = work / "bert", work / "reviews.jsonl"
    config = (
        f"transformers.BertConfig(vocab_size=VOCAB, hidden_size={size['width']}, num_hidden_layers={size['layers']}, "
        f"num_attention_heads={size['heads']}, intermediate_size={4 * size['width']}, "
        f"max_position_embeddings={size['length']}, num_labels=2, pad_token_id=0, LABELS)"
    )
    build = text_build(
        size,
        reviews,
        folder,
        size["n_records"],
        config,
        "transformers.BertForSequenceClassification",
        device,
        lr=1e-3,
        batch_size=32,
        init_copy=work / "bert-init",  # the kernel-movement reference: the same network at initialization
    )
    data = f"data={str(reviews)!r}, max_length={size['length']}, checkpoint=({str(folder)!r},), device={device!r}"
    common = "import attnaudit as aa\n"
    n = size["n"]
    return [
        ("train", build),
        ("kappa", common + f"r = aa.run(aa.KappaRequest({data}, n=({n},)))"),
        (
            "ntk-distance",
            common + f"r = aa.run(aa.NtkDistanceRequest({data}, reference_checkpoint={str(work / 'bert-init')!r}, "
            f"n_test={n}, kernel_points={max(4, n // 4)}))",
        ),
        (
            "malleability",
            common + f"r = aa.run(aa.MalleabilityRequest({data}, protocol='static', attacks=('hotflip', 'swap'), "
            f"eps=(1,), estimator='ekfac', n_train={n}, n_test={max(4, n // 4)}, seeds=2))",
        ),
        (
            "landscape",
            common + f"r = aa.run(aa.LandscapeRequest({data}, n_train={n}, points=0, grid=0, eigenvalues=2, "
            "hutchinson_samples=4, basin_directions=1))",
        ),
    ]


def distilbert_stages(size: dict, work: Path, device: str = "cpu") -> list[tuple[str, str]]:
    """A DistilBERT-configured classifier (random initialisation, briefly fine-tuned on the review
    set) and its malleability audit: projected estimator, static protocol, HotFlip (one token per
    text; deterministic, so the three seeds share its perturbed set), 3 seeds, a gradient store."""
    folder, reviews = work / "distilbert", work / "reviews-distil.jsonl"
    n_records = size["n_train"] + size["n_test"]
    config = (
        f"transformers.DistilBertConfig(vocab_size=VOCAB, dim={size['width']}, n_layers={size['layers']}, "
        f"n_heads={size['heads']}, hidden_dim={4 * size['width']}, max_position_embeddings=512, num_labels=2, "
        "pad_token_id=0, LABELS)"
    )
    build = text_build(
        size,
        reviews,
        folder,
        n_records,
        config,
        "transformers.DistilBertForSequenceClassification",
        device,
        lr=1e-4,
        batch_size=16,
    )
    data = f"data={str(reviews)!r}, max_length={size['length']}, checkpoint=({str(folder)!r},), device={device!r}"
    return [
        ("train", build),
        (
            "malleability",
            "import attnaudit as aa\n"
            f"r = aa.run(aa.MalleabilityRequest({data}, protocol='static', attacks=('hotflip',), eps=(1,), "
            f"estimator='projected', n_train={size['n_train']}, n_test={size['n_test']}, seeds=3, "
            f"store={str(work / 'store')!r}))",
        ),
    ]


LM_BUILD = """
import json, sys, torch, transformers
import numpy as np
from pathlib import Path
from tokenizers import Tokenizer, models, pre_tokenizers
work = Path({work!r})
vocab = {vocab}
words = ["<|pad|>", "<|unk|>"] + [f"w{{i}}" for i in range(vocab - 3)] + ["<|endoftext|>"]
tok = Tokenizer(models.WordLevel({{w: i for i, w in enumerate(words)}}, unk_token="<|unk|>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.add_special_tokens(["<|pad|>", "<|unk|>", "<|endoftext|>"])
# documents of {words_per_doc} words drawn from a Zipf law over the vocabulary (exponent 1.1, the
# rank-frequency shape of natural text), so the full softmax over the vocabulary is exercised
rng = np.random.default_rng(0)
ranks = np.arange(1, vocab - 3 + 1)
p = ranks ** -1.1
p /= p.sum()
with (work / "documents.jsonl").open("w", encoding="utf-8") as fh:
    for _ in range({n_docs}):
        ids = rng.choice(vocab - 3, size={words_per_doc}, p=p) + 2
        fh.write(json.dumps({{"text": " ".join(words[i] for i in ids)}}) + "\\n")
config = transformers.GPT2Config(vocab_size=vocab, n_positions=1024, n_embd={width}, n_layer={layers},
    n_head={heads}, pad_token_id=0, bos_token_id=vocab - 1, eos_token_id=vocab - 1)
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(config).eval()
for name in ("gpt2-base", "gpt2"):
    (work / name).mkdir(exist_ok=True)
    tok.save(str(work / name / "tokenizer.json"))
model.save_pretrained(work / "gpt2-base")  # random initialisation: the reference of the kernel movement
# a few Adam steps on a few documents: the checkpoint audited (its weights have moved from the base)
texts = [json.loads(line)["text"] for line in (work / "documents.jsonl").read_text().splitlines()[:{tune_docs}]]
ids = torch.tensor([tok.encode(t).ids[:{length}] for t in texts])
optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
model.train()
for step in range({steps}):
    batch = ids[step % len(ids) :: max(1, len(ids) // 4)][:4]
    loss = model(input_ids=batch, labels=batch).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
model.eval()
model.save_pretrained(work / "gpt2")
print(sum(p.numel() for p in model.parameters()))
"""


def lm_stages(size: dict, work: Path, device: str = "cpu") -> list[tuple[str, str]]:
    """A GPT-2-small-configured causal language model (12 layers, width 768, 12 heads, 50,257 words:
    124 M parameters; random initialisation, then a few Adam steps: no pretrained weights are at
    hand offline) on generated documents of ``length`` tokens, audited by all four analyses:
    malleability with the projected estimator over ``n_train`` training documents (the size
    target), the others on the smaller subsets a per-document Hessian or kernel can afford."""
    build = LM_BUILD.format(
        work=str(work),
        vocab=size["vocab"],
        words_per_doc=size["length"] + 16,
        n_docs=size["n_train"] + size["n_test"],
        width=size["width"],
        layers=size["layers"],
        heads=size["heads"],
        tune_docs=16,
        length=size["length"],
        steps=size["steps"],
    )
    data = (
        f"data={str(work / 'documents.jsonl')!r}, max_length={size['length']}, "
        f"checkpoint=({str(work / 'gpt2')!r},), device={device!r}"
    )
    common = "import attnaudit as aa\n"
    n = size["n_sub"]
    return [
        ("train", build),
        ("kappa", common + f"r = aa.run(aa.KappaRequest({data}, n=({n},)))"),
        (
            "ntk-distance",
            common + f"r = aa.run(aa.NtkDistanceRequest({data}, reference_checkpoint={str(work / 'gpt2-base')!r}, "
            f"n_test={n}, kernel_points={size['n_kernel']}, memory_budget=6144))",
        ),
        (
            "malleability",
            # FGSM on the input embeddings (each real token moved by at most 10% of its embedding's l2 norm)
            # and its random-sign control: one gradient pass each; HotFlip's candidate checks cost a forward
            # pass per candidate and document, out of reach over 50,257 words on 2 cores
            common + f"r = aa.run(aa.MalleabilityRequest({data}, protocol='static', attacks=('fgsm', 'sign'), "
            f"eps=(0.1,), norm='l2', estimator='projected', n_train={size['n_train']}, n_test={size['n_test']}, "
            f"seeds=1, store={str(work / 'store')!r}))",
        ),
        (
            "landscape",
            common + f"r = aa.run(aa.LandscapeRequest({data}, n_train={n}, points=0, grid=0, eigenvalues=1, "
            "hutchinson_samples=2, basin_directions=1))",
        ),
    ]


#: where each model's train stage leaves its checkpoint in the work folder (a file or a model folder)
CHECKPOINTS = {"deit-tiny": "deit.safetensors", "bert-mini": "bert", "distilbert": "distilbert", "gpt2-small": "gpt2"}


def checkpoint_params(work: Path, name: str) -> int:
    """The parameter count of ``name``'s checkpoint trained into ``work`` by an earlier run (the
    tensors of its safetensors files; tied weights are stored once)."""
    from safetensors import safe_open

    where = work / CHECKPOINTS[name]
    files = [where] if where.is_file() else sorted(where.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"no checkpoint of {name} in {work}: run its train stage into --out {work} first")
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():
                total += math.prod(fh.get_slice(key).get_shape())
    return total


def gemm_floor_seconds(params: int, n_train: int, n_test: int, device: str = "cpu") -> float:
    """Time of the one product influence cannot avoid: (n_train x P) @ (P x n_test), float32, on
    ``device`` (after one warm-up product, synchronised on a GPU)."""
    import torch

    a = torch.randn(n_train, params, device=device)
    b = torch.randn(params, n_test, device=device)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    a @ b
    sync()
    t0 = time.perf_counter()
    a @ b
    sync()
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cpu", help="device of every stage, training included")
    parser.add_argument(
        "--deadline", type=float, default=None, help="seconds for the whole benchmark: a stage past it is stopped"
    )
    parser.add_argument(
        "--models",
        default="deit-tiny,bert-mini",
        help="comma-separated: deit-tiny, bert-mini, distilbert (the malleability audit of a 67 M-parameter model), "
        "gpt2-small (a 124 M-parameter causal language model on documents of 256 tokens)",
    )
    parser.add_argument("--precision", default=None, help="--precision of every analysis (default: each one's auto)")
    parser.add_argument(
        "--n-train", type=int, default=None, help="override every model's audited training rows (n_train)"
    )
    parser.add_argument(
        "--stages",
        default=None,
        help="run only these stages (comma-separated: train,kappa,ntk-distance,malleability,landscape); without "
        "train, the models trained by an earlier run into the same --out are audited and the SCALE line names the "
        "stages it sums",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    sizes = SIZES["small" if args.small else "full"]
    if args.n_train is not None:
        sizes = {name: {**size, "n_train": args.n_train} for name, size in sizes.items()}
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "ATTNAUDIT_THREADS": str(args.threads),
        "PYTHONPATH": str(ROOT),
    }
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="attnaudit-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    summary = {}
    builders = {
        "deit-tiny": deit_stages,
        "bert-mini": bert_stages,
        "distilbert": distilbert_stages,
        "gpt2-small": lm_stages,
    }
    models = [(name, builders[name]) for name in args.models.split(",")]
    for index, (name, builder) in enumerate(models):
        total, peak, gpu_peak, params, stages, failed = 0.0, 0.0, 0.0, 0, {}, {}
        # with a deadline each model gets an equal share of the time left, so one slow model
        # cannot leave the other unmeasured
        model_start = time.perf_counter()
        share = None
        if args.deadline is not None:
            share = (args.deadline - (model_start - start)) / (len(models) - index)
        chosen = None if args.stages is None else set(args.stages.split(","))
        if chosen is not None and "train" not in chosen:
            params = checkpoint_params(work, name)
        for stage, code in builder(sizes[name], work, args.device):
            if chosen is not None and stage not in chosen:
                continue
            left = None if share is None else share - (time.perf_counter() - model_start)
            if left is not None and left < 1:
                failed[stage] = "not run: the deadline had passed"
                print(f"{name:10s} {stage:13s} not run (deadline)", flush=True)
                continue
            if stage != "train":
                if args.precision is not None:  # every analysis request of the stage at that precision
                    code = code.replace("Request(", f"Request(precision={args.precision!r}, ")
                code += REPORT.format(path=str(work / f"{name}-{stage}.json"))
            seconds, gib, out, error = _stage(code + GPU_PEAK, env, left)
            total += seconds
            peak = max(peak, gib)
            stages[stage] = seconds
            lines = out.strip().splitlines()
            gpu = [float(line.split()[1]) for line in lines if line.startswith("GPU_PEAK_GIB ")]
            lines = [line for line in lines if not line.startswith("GPU_PEAK_GIB ")]
            details = [line for line in lines if line.startswith(("STAGE_TIMINGS ", "STAGE_PLAN "))]
            lines = [line for line in lines if line not in details]
            if stage == "train" and lines and lines[-1].isdigit():
                params = int(lines[-1])
            on_gpu = ""
            if gpu and gpu[0] > 0:
                gpu_peak = max(gpu_peak, gpu[0])
                on_gpu = f", GPU {gpu[0]:.2f} GiB"
            print(f"{name:10s} {stage:13s} {seconds:8.1f} s  peak so far {gib:.2f} GiB{on_gpu}", flush=True)
            for line in details:
                print(f"{name:10s} {stage:13s}   {line}", flush=True)
            if error is not None:
                failed[stage] = error
                print(f"{name:10s} {stage:13s} FAILED: {error}", flush=True)
                if stage == "train":
                    break
        refused = f" failed={','.join(failed)}" if failed else ""
        if chosen is not None:
            refused += f" stages={','.join(stages)}"
        on_gpu = f" gpu_peak_gb={gpu_peak:.2f}" if gpu_peak else ""
        # the target is the audit (the four analyses); training the model first is set-up
        audit = sum(seconds for stage, seconds in stages.items() if stage != "train")
        print(
            f"SCALE model={name} params={params} n_train={sizes[name].get('n', sizes[name].get('n_train'))} total_s={total:.1f} audit_s={audit:.1f} "
            f"peak_gb={peak:.2f}"
            f"{on_gpu}{refused}",
            flush=True,
        )
        summary[name] = {
            "params": params,
            "total_s": total,
            "audit_s": audit,
            "peak_gb": peak,
            "gpu_peak_gb": gpu_peak,
            "stages_s": stages,
            "failed": failed,
        }
        n = sizes[name].get("n", sizes[name].get("n_train"))
        n_test = sizes[name].get("n_test", max(4, n // 4))
        # the floor's dense (n_train x P) operand must fit in memory (2,000 x 67 M floats do not)
        if params and "malleability" in stages and "malleability" not in failed and n * params * 4 < 2**32:
            floor = gemm_floor_seconds(params, n, n_test, args.device)
            print(f"RATIO influence_over_gemm_floor_{name.replace('-', '_')}={stages['malleability'] / floor:.1f}")
        (work / "scale.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (work / "scale.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
