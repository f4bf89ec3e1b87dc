"""Dataset loading, batched augmentation and the tensor-indexing loader of ``zoo.data``."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

import tengrad_fx.zoo.data as zd
from tengrad_fx.zoo import ArrayDataset, augment_batch, batches, get_dataset, num_batches, subset

# --------------------------------------------------------------------------- helpers


def _idx_bytes(arr: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def _write_idx(directory: Path, stem: str, arr: np.ndarray, gz: bool) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    data = _idx_bytes(arr)
    if gz:
        with gzip.open(directory / f"{stem}.gz", "wb") as f:
            f.write(data)
    else:
        (directory / stem).write_bytes(data)


def _fake_fmnist(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 10, n, dtype=np.uint8)


def _write_cifar_batch(path: Path, images: np.ndarray, labels: list[int], label_key: str, byte_keys: bool) -> None:
    batch: dict = {"data": images.reshape(len(labels), -1), label_key: labels, "batch_label": "fake"}
    if label_key == "fine_labels":
        batch["coarse_labels"] = [19 - lab % 20 for lab in labels]  # must not be picked up
    if byte_keys:
        batch = {k.encode(): v for k, v in batch.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(batch, f)


def _normalised(images: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    x = torch.from_numpy(images.astype(np.float32)) / 255.0
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    return (x - m) / s


@pytest.fixture
def no_debian(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    missing = tmp_path / "no-such-debian-dir"
    monkeypatch.setattr(zd, "DEBIAN_FASHION_MNIST_DIR", missing)
    return missing


# --------------------------------------------------------------------------- Fashion-MNIST


def test_fashion_mnist_from_debian_package() -> None:
    if not all((zd.DEBIAN_FASHION_MNIST_DIR / f"{s}.gz").is_file() for pair in zd._FMNIST_FILES.values() for s in pair):
        pytest.skip(f"Debian dataset-fashion-mnist files not in {zd.DEBIAN_FASHION_MNIST_DIR}")
    train = get_dataset("fashion-mnist", "train")
    assert train.x.shape == (60000, 1, 28, 28) and train.x.dtype == torch.float32
    assert train.y.shape == (60000,) and train.y.dtype == torch.int64
    assert abs(train.x.mean().item()) < 0.01 and abs(train.x.std().item() - 1.0) < 0.01
    assert torch.equal(train.y.bincount(), torch.full((10,), 6000))
    assert not train.augment and train.num_classes == 10
    del train
    test = get_dataset("fashion-mnist", "test")
    assert test.x.shape == (10000, 1, 28, 28) and test.y.shape == (10000,)
    assert abs(test.x.mean().item()) < 0.02


def test_fashion_mnist_from_data_dir(tmp_path: Path, no_debian: Path) -> None:
    train_img, train_lab = _fake_fmnist(5, 0)
    test_img, test_lab = _fake_fmnist(3, 1)
    # train split: uncompressed files directly in data_dir
    _write_idx(tmp_path, "train-images-idx3-ubyte", train_img, gz=False)
    _write_idx(tmp_path, "train-labels-idx1-ubyte", train_lab, gz=False)
    # test split: gzipped, torchvision layout
    raw = tmp_path / "FashionMNIST" / "raw"
    _write_idx(raw, "t10k-images-idx3-ubyte", test_img, gz=True)
    _write_idx(raw, "t10k-labels-idx1-ubyte", test_lab, gz=True)
    for split, img, lab in [("train", train_img, train_lab), ("test", test_img, test_lab)]:
        ds = get_dataset("Fashion-MNIST", split, data_dir=str(tmp_path))
        assert ds.x.shape == (len(lab), 1, 28, 28) and len(ds) == len(lab)
        torch.testing.assert_close(ds.x, _normalised(img[:, None], (0.2860,), (0.3530,)))
        assert torch.equal(ds.y, torch.from_numpy(lab.astype(np.int64)))
        torch.testing.assert_close(ds.pad_value, torch.tensor([-0.2860 / 0.3530]))


def test_data_dir_takes_priority_over_debian(tmp_path: Path) -> None:
    img, lab = _fake_fmnist(4, 2)
    _write_idx(tmp_path, "t10k-images-idx3-ubyte", img, gz=True)
    _write_idx(tmp_path, "t10k-labels-idx1-ubyte", lab, gz=True)
    assert len(get_dataset("fashion-mnist", "test", data_dir=tmp_path)) == 4


def test_fashion_mnist_missing_names_all_options(tmp_path: Path, no_debian: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError) as info:
        get_dataset("fashion-mnist", "train", data_dir=empty)
    msg = str(info.value)
    assert str(empty) in msg
    assert "apt-get install dataset-fashion-mnist" in msg
    assert str(no_debian) in msg
    assert "download=True" in msg and "--download" in msg
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        get_dataset("fashion-mnist", "test")


def test_fashion_mnist_download_branch(tmp_path: Path, no_debian: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """download=True goes through torchvision (faked here: no network) and reads its raw folder."""
    import torchvision

    img, lab = _fake_fmnist(6, 3)
    calls: list[tuple[str, bool]] = []

    class FakeFashionMNIST:
        def __init__(self, root: str, train: bool, download: bool) -> None:
            calls.append((root, download))
            raw = Path(root) / "FashionMNIST" / "raw"
            _write_idx(raw, "train-images-idx3-ubyte", img, gz=False)
            _write_idx(raw, "train-labels-idx1-ubyte", lab, gz=False)

    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", FakeFashionMNIST)
    root = tmp_path / "dl"
    ds = get_dataset("fashion-mnist", "train", data_dir=root, download=True)
    assert calls == [(str(root), True)]
    assert len(ds) == 6 and torch.equal(ds.y, torch.from_numpy(lab.astype(np.int64)))


def test_read_idx_rejects_bad_header(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x00\x00\x0d\x01" + (3).to_bytes(4, "big") + b"abc")
    with pytest.raises(ValueError, match="IDX"):
        zd.read_idx(bad)
    short = tmp_path / "short"
    short.write_bytes(_idx_bytes(np.zeros((2, 2, 2), np.uint8))[:-1])
    with pytest.raises(ValueError, match="header"):
        zd.read_idx(short)


# --------------------------------------------------------------------------- CIFAR


def test_cifar10_from_pickles(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    folder = tmp_path / "cifar-10-batches-py"
    train_imgs, train_labels = [], []
    for i in range(1, 6):
        img = rng.integers(0, 256, (2, 3, 32, 32), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, 2)]
        _write_cifar_batch(folder / f"data_batch_{i}", img, labels, "labels", byte_keys=False)
        train_imgs.append(img)
        train_labels += labels
    test_img = rng.integers(0, 256, (3, 3, 32, 32), dtype=np.uint8)
    _write_cifar_batch(folder / "test_batch", test_img, [7, 8, 9], "labels", byte_keys=True)

    train = get_dataset("cifar10", "train", data_dir=tmp_path)
    assert train.x.shape == (10, 3, 32, 32) and train.x.dtype == torch.float32
    assert train.y.tolist() == train_labels and train.y.dtype == torch.int64
    torch.testing.assert_close(train.x, _normalised(np.concatenate(train_imgs), zd.CIFAR10_MEAN, zd.CIFAR10_STD))
    assert train.augment and train.num_classes == 10
    torch.testing.assert_close(train.pad_value, -torch.tensor(zd.CIFAR10_MEAN) / torch.tensor(zd.CIFAR10_STD))

    test = get_dataset("cifar-10", "test", data_dir=folder)  # data_dir may also be the folder itself
    assert test.y.tolist() == [7, 8, 9] and not test.augment
    torch.testing.assert_close(test.x, _normalised(test_img, zd.CIFAR10_MEAN, zd.CIFAR10_STD))
    assert not get_dataset("cifar10", "train", data_dir=tmp_path, augment=False).augment


def test_cifar100_fine_labels(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    folder = tmp_path / "cifar-100-python"
    img = rng.integers(0, 256, (4, 3, 32, 32), dtype=np.uint8)
    _write_cifar_batch(folder / "train", img, [0, 55, 99, 3], "fine_labels", byte_keys=True)
    _write_cifar_batch(folder / "test", img[:1], [42], "fine_labels", byte_keys=False)
    train = get_dataset("cifar100", "train", data_dir=tmp_path)
    assert train.y.tolist() == [0, 55, 99, 3] and train.num_classes == 100
    torch.testing.assert_close(train.x, _normalised(img, zd.CIFAR100_MEAN, zd.CIFAR100_STD))
    assert get_dataset("cifar100", "test", data_dir=tmp_path).y.tolist() == [42]


@pytest.mark.parametrize(("name", "folder"), [("cifar10", "cifar-10-batches-py"), ("cifar100", "cifar-100-python")])
def test_cifar_missing_names_both_options(tmp_path: Path, name: str, folder: str) -> None:
    with pytest.raises(FileNotFoundError) as info:
        get_dataset(name, "train", data_dir=tmp_path)
    msg = str(info.value)
    assert str(tmp_path / folder) in msg and "--data-dir" in msg
    assert "download=True" in msg


def test_bad_name_or_split() -> None:
    with pytest.raises(ValueError, match="cifar10"):
        get_dataset("imagenet", "train")
    with pytest.raises(ValueError, match="split"):
        get_dataset("cifar10", "val")


# --------------------------------------------------------------------------- augment_batch


def _all_crops(padded: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Every (dy, dx, flip) crop of one padded image: K x C x h x w."""
    offsets = [(dy, dx) for dy in range(padded.shape[1] - h + 1) for dx in range(padded.shape[2] - w + 1)]
    crops = [padded[:, dy : dy + h, dx : dx + w] for dy, dx in offsets]
    stacked = torch.stack(crops)
    return torch.cat([stacked, stacked.flip(-1)])


def test_augment_batch_shape_and_determinism() -> None:
    x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    a = augment_batch(x, torch.Generator().manual_seed(1))
    b = augment_batch(x, torch.Generator().manual_seed(1))
    c = augment_batch(x, torch.Generator().manual_seed(2))
    assert a.shape == x.shape and a.dtype == x.dtype
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    changed = [(not torch.equal(a[i], x[i])) for i in range(16)]
    assert sum(changed) >= 8  # P(unchanged) = 1/162 per image


def test_augment_batch_matches_per_image_reference() -> None:
    """Crop of the padded image at the drawn offsets (then mirrored when flipped) == output."""
    n, c, h, w, p = 24, 2, 8, 6, 3
    x = torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(0))
    pad_value = torch.tensor([-1.5, 2.5])
    out = augment_batch(x, torch.Generator().manual_seed(5), padding=p, pad_value=pad_value)
    g = torch.Generator().manual_seed(5)  # replay the documented draw order: dy, dx, flip
    dy = torch.randint(0, 2 * p + 1, (n,), generator=g)
    dx = torch.randint(0, 2 * p + 1, (n,), generator=g)
    flips = torch.rand(n, generator=g) < 0.5
    padded = pad_value.view(1, c, 1, 1).repeat(n, 1, h + 2 * p, w + 2 * p)
    padded[:, :, p : p + h, p : p + w] = x
    for i in range(n):
        ref = padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w]
        if flips[i]:
            ref = ref.flip(-1)
        assert torch.equal(out[i], ref), i
    assert flips.any() and (~flips).any()
    # where the crop is centred and unflipped it is the original image
    centred = (dy == p) & (dx == p) & ~flips
    for i in torch.nonzero(centred).flatten().tolist():
        assert torch.equal(out[i], x[i])


def test_augment_batch_outputs_are_valid_crops() -> None:
    """Draw-order independent: each output is one of the 2*(2p+1)^2 crops, and several kinds occur."""
    n, c, h, w, p = 32, 3, 8, 8, 4
    x = torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(3))
    out = augment_batch(x, torch.Generator().manual_seed(4), padding=p)
    padded = torch.nn.functional.pad(x, (p, p, p, p))
    matches = []
    for i in range(n):
        crops = _all_crops(padded[i], h, w)
        hit = torch.nonzero((crops == out[i]).flatten(1).all(1)).flatten()
        assert hit.numel() >= 1, i
        matches.append(int(hit[0]))
    k = (2 * p + 1) ** 2
    assert any(m >= k for m in matches) and any(m < k for m in matches)  # both flipped and not
    assert len({m % k for m in matches}) > 5  # many different offsets


def test_augment_batch_pads_with_pad_value_and_identity_without_randomness() -> None:
    x = torch.zeros(64, 2, 4, 4)
    out = augment_batch(x, torch.Generator().manual_seed(0), padding=2, pad_value=torch.tensor([3.0, -1.0]))
    assert set(out[:, 0].unique().tolist()) == {0.0, 3.0}
    assert set(out[:, 1].unique().tolist()) == {0.0, -1.0}
    y = torch.randn(5, 3, 7, 7)
    assert torch.equal(augment_batch(y, torch.Generator().manual_seed(0), padding=0, flip=False), y)


# --------------------------------------------------------------------------- batches / subset


def _indexed_dataset(n: int, augment: bool) -> ArrayDataset:
    x = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 1, 4, 4).clone()
    x = x + torch.randn(n, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    return ArrayDataset(x=x, y=torch.arange(n), num_classes=n, augment=augment, pad_value=torch.tensor([0.0]))


@pytest.mark.parametrize("augment", [False, True])
def test_batches_cover_epoch_once_and_are_deterministic(augment: bool) -> None:
    ds = _indexed_dataset(103, augment)
    epoch = list(batches(ds, 10, shuffle=True, generator=torch.Generator().manual_seed(0)))
    assert [len(yb) for _, yb in epoch] == [10] * 10 + [3] == [len(xb) for xb, _ in epoch]
    assert len(epoch) == num_batches(ds, 10)
    ys = torch.cat([yb for _, yb in epoch])
    assert torch.equal(ys.sort().values, torch.arange(103))
    assert not torch.equal(ys, torch.arange(103))
    again = list(batches(ds, 10, shuffle=True, generator=torch.Generator().manual_seed(0)))
    for (xa, ya), (xb, yb) in zip(epoch, again, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    xs = torch.cat([xb for xb, _ in epoch])
    if augment:
        assert not torch.equal(xs, ds.x[ys])
    else:
        assert torch.equal(xs, ds.x[ys])


def test_batches_successive_epochs_differ_and_drop_last() -> None:
    ds = _indexed_dataset(50, augment=False)
    g = torch.Generator().manual_seed(1)
    e1 = torch.cat([yb for _, yb in batches(ds, 8, shuffle=True, generator=g)])
    e2 = torch.cat([yb for _, yb in batches(ds, 8, shuffle=True, generator=g)])
    assert not torch.equal(e1, e2)
    dropped = list(batches(ds, 8, shuffle=True, generator=torch.Generator().manual_seed(1), drop_last=True))
    assert len(dropped) == num_batches(ds, 8, drop_last=True) == 6
    assert all(len(yb) == 8 for _, yb in dropped)
    assert len(torch.cat([yb for _, yb in dropped]).unique()) == 48


def test_batches_without_shuffle_are_in_order_and_unaugmented() -> None:
    ds = _indexed_dataset(25, augment=True)
    out = list(batches(ds, 10))
    assert torch.equal(torch.cat([yb for _, yb in out]), torch.arange(25))
    assert torch.equal(torch.cat([xb for xb, _ in out]), ds.x)
    with pytest.raises(ValueError):
        next(batches(ds, 0))


def test_subset() -> None:
    ds = _indexed_dataset(40, augment=True)
    a, b = subset(ds, 10), subset(ds, 10)
    assert len(a) == 10 and torch.equal(a.y, b.y) and torch.equal(a.x, ds.x[a.y])
    assert len(a.y.unique()) == 10 and not torch.equal(a.y, torch.arange(10))
    assert a.augment and a.num_classes == ds.num_classes and a.pad_value is ds.pad_value
    assert torch.equal(subset(ds, 5, seed=None).y, torch.arange(5))
    assert len(subset(ds, 1000)) == 40
    assert torch.equal(ds[3][1], torch.tensor(3))
