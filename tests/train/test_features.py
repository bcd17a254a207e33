"""Feature extraction on the bundled target: exactness, offline == online, resume, fingerprints, 2 ranks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train.features as features
from train.cache import CacheError, FeatureCache, bytes_per_token
from train.config import load_recipe
from train.data.pipeline import prepare_data
from train.dataset import CachedFeatures, Packed, make_loader, training_data
from train.features import extract

REPO = Path(__file__).resolve().parents[2]
RECIPE = f"""
target: {REPO / "recipes" / "targets" / "stories260K"}
data:
  max_length: 40
  held_out: 0.2
  regenerate: {{enabled: true, num_samples: 20, max_new_tokens: 48, batch_size: 8, shard_size: 8, stop_ids: [1]}}
features: {{hidden_ids: [0, 2, 5], dtype: fp32, topk: 4, shard_size: 6, batch_size: 4, target_dtype: float32}}  # = the fp32 `stories` fixture
"""


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("features")
    (d / "stories_test.yaml").write_text(RECIPE)
    return d


def make_recipe(work: Path, name: str, *overrides: str):
    return load_recipe(
        work / "stories_test.yaml",
        [
            f"run_dir={work / name}",
            f"data.regenerate.out_dir={work / 'regen'}",
            f"features.cache_dir={work / name / 'features'}",
            *overrides,
        ],
    )


@pytest.fixture(scope="session")
def built(work, stories, threads1):
    """One uninterrupted single-process extraction (recipe, cache)."""
    r = make_recipe(work, "a")
    with threads1():
        extract(r, target=stories)
    return r, FeatureCache.open(r.features.cache_dir)


def test_stored_features_equal_output_hidden_states(built, stories):
    r, cache = built
    data = prepare_data(r, stories)
    rows = list(data.train) + list(data.eval)
    assert len(cache) == len(rows) == 20 and cache.index["n_eval"] == 4
    assert cache.index["token_stats"]["truncated"] > 0  # 48 new tokens + BOS > max_length 40
    for i, row in enumerate(rows):
        seq = cache.sequence(i)
        assert seq["input_ids"].tolist() == row["input_ids"] and seq["loss_mask"].tolist() == row["loss_mask"]
        out = stories.model(seq["input_ids"][None], output_hidden_states=True)
        for h in (0, 2, 5):
            torch.testing.assert_close(seq["hidden"][h], out.hidden_states[h][0], atol=1e-5, rtol=1e-5)
        top = torch.softmax(out.logits[0], -1).topk(4)
        torch.testing.assert_close(seq["topk_probs"], top.values, atol=1e-5, rtol=1e-5)
        assert (seq["topk_ids"] == top.indices).float().mean() > 0.99  # ties aside
        assert seq["argmax"].dtype == torch.long
        assert (seq["argmax"] == out.logits[0].argmax(-1)).float().mean() > 0.99  # the target's own next token
        assert seq["logz"].dtype == torch.float32  # its normaliser, stored in full precision
        torch.testing.assert_close(seq["logz"], out.logits[0].float().logsumexp(-1), atol=1e-4, rtol=1e-5)
    want = bytes_per_token(64, 3, "fp32", 4)
    assert want <= cache.index["bytes_per_token"] < want * 1.2  # + offsets and headers


def test_a_bf16_cache_stores_the_normaliser_of_its_own_rounded_state(stories):
    """logz normalises what a loss computes from the stored hidden[L]: from the state rounded to the cache's dtype
    (its full-precision logits' logsumexp differs by ~1e-2 in bf16 on the chat target), while argmax stays the
    target's own."""
    ids = torch.tensor([[1, 45, 67, 89, 12, 230, 7, 99, 140, 3]])
    am = torch.ones_like(ids)
    L = stories.num_layers
    f = features.compute_features(stories, ids, am, [L], stored=torch.bfloat16)
    with torch.no_grad():
        full = stories.model(ids).logits[0].float()
        state = f["hidden"][L][0].to(torch.bfloat16).float()  # what the cache keeps
        want = stories.lm_head(state).float().logsumexp(-1)  # hidden[L] is post-norm
    torch.testing.assert_close(f["logz"][0], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(f["argmax"][0], full.argmax(-1))
    plain = features.compute_features(stories, ids, am, [L])  # online: the state is not rounded
    torch.testing.assert_close(plain["logz"][0], full.logsumexp(-1), atol=1e-4, rtol=1e-5)


def test_offline_batches_equal_online_batches(built, stories):
    r, _ = built
    online = load_recipe(r_path(r), ["features.mode=online"] + overrides_of(r))
    for pack in (0, 96):
        off_ds, off_fn = training_data(r, stories, "train", pack_length=pack)
        on_ds, on_fn = training_data(online, stories, "train", pack_length=pack)
        if pack:
            assert isinstance(off_ds, Packed) and len(off_ds) < 16
        n = 0
        for a, b in zip(make_loader(off_ds, 3, seed=7), make_loader(on_ds, 3, seed=7)):
            a, b = off_fn(a), on_fn(b)
            assert sorted(a) == sorted(b)
            for k in ("input_ids", "attention_mask", "position_ids", "loss_mask", "topk_ids", "argmax"):
                assert torch.equal(a[k], b[k]), k
            torch.testing.assert_close(a["topk_probs"], b["topk_probs"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a["logz"], b["logz"], atol=1e-4, rtol=1e-5)
            for h in (0, 2, 5):
                assert a["hidden"][h].dtype == torch.float32
                torch.testing.assert_close(a["hidden"][h], b["hidden"][h], atol=1e-5, rtol=1e-5)
            n += 1
        assert n == len(off_ds) // 3 + (len(off_ds) % 3 > 0)
    eval_ds, _ = training_data(r, stories, "eval")
    assert len(eval_ds) == 4


def test_max_sequences_keeps_the_first_train_sequences(built, stories):
    """train.max_sequences: the first N train sequences, offline and online alike; eval unchanged; too many refused."""
    r, _ = built
    full, _ = training_data(r, stories, "train")
    for mode in ("offline", "online"):
        limited = load_recipe(r_path(r), overrides_of(r) + [f"features.mode={mode}", "train.max_sequences=5"])
        ds, _ = training_data(limited, stories, "train")
        assert len(ds) == 5 < len(full)
        for i in range(5):
            assert torch.equal(ds[i]["input_ids"], full[i]["input_ids"]), (mode, i)
        assert len(training_data(limited, stories, "eval")[0]) == 4
    too_many = load_recipe(r_path(r), overrides_of(r) + [f"train.max_sequences={len(full) + 1}"])
    with pytest.raises(ValueError, match=rf"train.max_sequences={len(full) + 1} but the data has only {len(full)}"):
        training_data(too_many, stories, "train")


def r_path(r) -> Path:
    return Path(r.run_dir).parent / "stories_test.yaml"


def overrides_of(r) -> list[str]:
    return [
        f"run_dir={r.run_dir}",
        f"data.regenerate.out_dir={r.data.regenerate.out_dir}",
        f"features.cache_dir={r.features.cache_dir}",
    ]


def test_seeded_shuffling_is_deterministic(built):
    _, cache = built
    d = CachedFeatures(cache, "train")
    order = lambda seed: [b["input_ids"][:, 1].tolist() for b in make_loader(d, 4, seed)]  # noqa: E731
    assert order(3) == order(3) and order(3) != order(4)


def test_killed_extraction_resumes_to_identical_shards(built, work, stories, monkeypatch):
    r, cache = built
    r2 = make_recipe(work, "b")
    real, calls = features.write_shard, []

    def crash_on_third(path, *a, **kw):
        calls.append(path)
        if len(calls) == 3:
            path.with_name(f".{path.name}.999.tmp").write_bytes(b"half a shard")  # what a kill leaves behind
            raise KeyboardInterrupt("killed")
        return real(path, *a, **kw)

    monkeypatch.setattr(features, "write_shard", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        extract(r2, target=stories)
    monkeypatch.setattr(features, "write_shard", real)
    out2 = Path(r2.features.cache_dir)
    assert sorted(p.name for p in out2.glob("shard_*")) == ["shard_00000.safetensors", "shard_00001.safetensors"]
    with pytest.raises(CacheError, match="`python -m train RECIPE.yaml` builds it"):
        FeatureCache.open(out2)  # no index yet: not usable
    index = extract(r2, target=stories)
    assert not list(out2.glob(".*tmp"))
    out1 = Path(r.features.cache_dir)
    names = sorted(p.name for p in out1.glob("shard_*"))
    assert names == sorted(p.name for p in out2.glob("shard_*")) and len(names) == 4
    for n in names:
        assert (out1 / n).read_bytes() == (out2 / n).read_bytes(), n
    assert index["fingerprint"] == cache.index["fingerprint"]


def test_mismatched_or_damaged_cache_is_an_error(built, work, stories, tmp_path):
    r, _ = built
    other = load_recipe(r_path(r), overrides_of(r) + ["features.topk=2"])
    with pytest.raises(CacheError, match=r"does not match this recipe/target \(topk: cache 4 vs now 2\).*Rebuild it"):
        extract(other, target=stories)
    with pytest.raises(CacheError, match="does not match"):
        training_data(load_recipe(r_path(r), overrides_of(r) + ["data.max_length=30"]), stories)
    with pytest.raises(ValueError, match=r"hidden-state ids \[6\] out of range 0\.\.5"):
        extract(load_recipe(r_path(r), overrides_of(r) + ["features.hidden_ids=[2,5,6]"]), target=stories)
    with pytest.raises(ValueError, match=r"lacks \[5\], which a medusa drafter needs"):
        extract(
            load_recipe(r_path(r), overrides_of(r) + ["features.hidden_ids=[2]", "drafter.kind=medusa"]), target=stories
        )
    # a damaged shard is refused, naming the file and how to rebuild
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in Path(r.features.cache_dir).iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    (broken / "shard_00001.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(CacheError, match="shard_00001.safetensors is unreadable.*delete it and rerun"):
        FeatureCache.open(broken)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_cpu_ranks_equal_one_process(built, work):
    """DESIGN §7: two real CPU ranks via accelerate launch --multi_gpu with ACCELERATE_USE_CPU (gloo).
    Both stages are split across the ranks: regeneration (fresh directory) and extraction."""
    r, cache = built
    out, regen_two = work / "two", work / "regen_two"
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "true",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        "-m",
        "train.features",
        str(r_path(r)),
        *overrides_of(r),
        f"features.cache_dir={out}",
        f"data.regenerate.out_dir={regen_two}",
    ]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "on 2 process(es)" in res.stdout, res.stdout[-2000:]
    regen_one = Path(r.data.regenerate.out_dir)
    for p in sorted(regen_one.glob("shard_*.jsonl")):
        assert (regen_two / p.name).read_text() == p.read_text()  # shard s is seeded by s, whichever rank ran it
    two = FeatureCache.open(out, cache.index["fingerprint"])
    assert [(s["file"], s["tokens"]) for s in two.index["shards"]] == [
        (s["file"], s["tokens"]) for s in cache.index["shards"]
    ]
    for name in (s["file"] for s in cache.index["shards"]):
        a, b = load_file(str(Path(r.features.cache_dir) / name)), load_file(str(out / name))
        assert sorted(a) == sorted(b)
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-6)


def test_cli_reports_bad_input_and_online_mode(built, capsys):
    r, _ = built
    assert features.main([str(r_path(r)), *overrides_of(r), "data.max_lenght=3"]) == 2
    assert "did you mean 'data.max_length'" in capsys.readouterr().err
    assert features.main([str(r_path(r)), *overrides_of(r), "features.mode=online"]) == 0
    assert "nothing to extract" in capsys.readouterr().err
    assert features.main([str(r_path(r)), *overrides_of(r)]) == 0  # the cache of `built`: already complete
    assert "is up to date" in capsys.readouterr().out
