"""Data layer: every source becomes an (n, d) float64 matrix X plus int64 labels y.

Sources (``DataSpec.dataset`` or ``DataSpec.data``):

* ``digits``: scikit-learn's bundled 8x8 digits (1,797 images, values 0..16 scaled to
  [0, 1]); needs no network. It has no official split, so a fixed permutation
  (``numpy.random.default_rng(0)``, independent of ``DataSpec.seed``) puts the first 80 %
  (1,437 images) in ``train`` and the other 360 in ``test``.
* ``mnist``, ``fashion-mnist``: torchvision's on-disk layout
  ``<data_dir>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`` (and
  ``FashionMNIST/raw``), read with the IDX reader below, so one split loads when only its
  files exist. Pixels / 255, in [0, 1]; feature_shape (1, 28, 28).
* ``cifar10``: torchvision's ``<data_dir>/cifar-10-batches-py/{data_batch_1..5,test_batch}``
  pickles; pixels / 255; feature_shape (3, 32, 32) (channel-major, as stored). The pickles
  are read with a restricted unpickler that builds only what a genuine batch holds (dicts,
  lists, strings, ints and uint8 numpy arrays) and refuses any other object, so a crafted
  batch cannot run code.
* ``synthetic``: X = U diag(s) V^T with exact singular values s log-spaced from 1 down to
  1/kappa over rank r, so kappa(X) = kappa and kappa(X X^T) = kappa^2 at rank r.
* a user file or image folder (``DataSpec.data``): .npz, .npy, .safetensors, .pt/.pth,
  .csv, or a folder with one sub-folder of images per class. ``split`` does not apply
  (a file is one split; use :func:`holdout_split`).

Limits. Seeds are integers in 0..MAX_SEED (2**32 - 1; :func:`check_seed`); labels are class
indices 0..K-1 with K <= MAX_CLASSES (100,000).

Conventions. ``--classes`` keeps the original label values (no remapping) and
``n_classes`` stays the size of the full label space (10 for MNIST; max label + 1 over the
whole user file; 0 for unlabelled data), so a model head sized ``n_classes`` fits every
subset. Subsets are chosen after class filtering by a seeded permutation (or per class
when stratified) and kept in original row order; ``info`` records the seed and a checksum
of the chosen row indices (indices into the full split/file). Preprocessing statistics
(means, stds) are computed on the returned rows. ``--download`` is the only thing that
writes to disk (through torchvision); nothing else creates directories.

Layout: :mod:`.spec` (DataSpec, Dataset, limits, seed and class parsing, message
helpers), :mod:`.readers` (IDX, CIFAR batches, user files), :mod:`.builtin` (digits,
MNIST / Fashion-MNIST, CIFAR-10, synthetic), :mod:`.selection` (class filter, subsets,
stratification, holdout split, assembly), :mod:`.preprocess`, and :mod:`.loader`
(:func:`load_dataset`). Every name is re-exported here.
"""

from attnaudit.data.builtin import (
    SYNTHETIC_CLASSES,
    default_data_dir,
    synthetic_matrix,
)
from attnaudit.data.loader import load_dataset
from attnaudit.data.recipe import HoldoutRecipe
from attnaudit.data.preprocess import apply_preprocess, ntk_scale_factor
from attnaudit.data.readers import (
    CSV_LABEL_COLUMNS,
    IMAGE_SUFFIXES,
    USER_SUFFIXES,
    X_NAMES,
    Y_NAMES,
    read_idx,
)
from attnaudit.data.selection import holdout_split, subset
from attnaudit.data.spec import (
    DATASETS,
    MAX_CLASSES,
    MAX_SEED,
    PREPROCESS,
    SPLITS,
    Dataset,
    DataSpec,
    check_seed,
    data_fingerprint,
    image_shape,
    parse_classes,
)

__all__ = [
    "CSV_LABEL_COLUMNS",
    "DATASETS",
    "DataSpec",
    "Dataset",
    "HoldoutRecipe",
    "IMAGE_SUFFIXES",
    "MAX_CLASSES",
    "MAX_SEED",
    "PREPROCESS",
    "SPLITS",
    "SYNTHETIC_CLASSES",
    "USER_SUFFIXES",
    "X_NAMES",
    "Y_NAMES",
    "apply_preprocess",
    "check_seed",
    "data_fingerprint",
    "default_data_dir",
    "image_shape",
    "holdout_split",
    "load_dataset",
    "ntk_scale_factor",
    "subset",
    "parse_classes",
    "read_idx",
    "synthetic_matrix",
]
