"""The model card every export writes (README.md): Hub front matter that parses, the sections, a τ table only
when the run recorded an evaluation, the serve commands per format; and the shipped drafter's card."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from decode.target import Target
from drafters.serving.card_facts import FETCHED, data_rows, target_license
from drafters.serving.checkpoint import save_drafter
from drafters.serving.export import export
from drafters.serving.model_card import CardFacts, Evaluation, model_card
from tests.conftest import REPO, tiny_model
from tests.drafters.batches import build

SHIPPED = REPO / "recipes" / "smollm2-135m" / "drafters" / "eagle3"
SECTIONS = ["## Target", "## Data", "## Training", "## Evaluation", "## Serving"]
NO_EVAL = "No evaluation is recorded with this drafter"
RECIPE = {
    "name": "tiny-eagle3",
    "seed": 0,
    "data": {
        "source": "chats.jsonl",
        "max_records": 100,
        "max_length": 256,
        "held_out": 0.05,
        "regenerate": {"enabled": True, "temperature": 0.7, "top_p": 0.95, "max_new_tokens": 64, "engine": "hf"},
    },
    "train": {
        "steps": 20,
        "batch_size": 4,
        "grad_accum": 1,
        "optimizer": "muon",
        "lr": 1e-3,
        "mixed_precision": "bf16",
        "threads": 1,
        "sim_chain": 8,
        "sim_max_new_tokens": 64,
        "sim_tree": "dynamic:topk=8,depth=6,nodes=24",
    },
}
TRAIN_ROWS = [
    {"step": 10, "loss": 3.0, "tokens_per_s": 100.0, "trained_tokens": 1000},
    {"step": 20, "loss": 2.0, "tokens_per_s": 200.0, "trained_tokens": 3000},
]
EVAL_ROW = {
    "step": 20,
    "eval/loss": 2.5,
    "eval/sim_tau_chain": 1.5,
    "eval/sim_tau_tree": 2.0,
    "eval/sim_prompts": 8,
    "eval/sim_accept_by_depth_chain": [0.4, 0.1],
    "eval/sim_matches_ar": 1.0,
}


def split(card: str) -> tuple[dict, str]:
    """(front matter as parsed YAML, the markdown body)."""
    assert card.startswith("---\n")
    head, body = card[4:].split("\n---\n", 1)
    return yaml.safe_load(head), body


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3 target test_export.py uses, with a Hub card naming its licence."""
    out = tmp_path_factory.mktemp("target")
    tiny_model("qwen3", seed=3).save_pretrained(out)
    (out / "README.md").write_text("---\nlicense: apache-2.0\ntags: [tiny]\n---\n# a tiny target\n")
    return out


def run_dir(tmp: Path, module, target_dir: Path, recipe: dict | None = None, rows: list[dict] = ()) -> Path:
    save_drafter(module, tmp / "run" / "export", recipe=recipe, target_id=str(target_dir))
    if rows:
        (tmp / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp / "run"


def test_card_is_hub_metadata_then_the_sections():
    facts = CardFacts(
        fmt="eagle3",
        kind="eagle3",
        target="org/model",
        directory="out/e3",
        license="mit",
        data=(("source", "chats.jsonl"),),
        training=(("steps", "10 optimizer steps"),),
        evaluations=(Evaluation("MT-bench", "80 first turns", (("chain k=8", "1.65", "1.20x"),)),),
    )
    meta, body = split(model_card(facts))
    assert meta == {
        "base_model": "org/model",
        "library_name": "sglang",
        "license": "mit",
        "tags": ["speculative-decoding", "eagle3", "draftsmith", "sglang", "vllm"],
    }
    assert [ln for ln in body.splitlines() if ln.startswith("## ")] == SECTIONS
    assert "| chain k=8 | 1.65 | 1.20x |" in body and NO_EVAL not in body
    assert (
        "vllm serve org/model --speculative-config "
        """'{"method": "eagle3", "model": "out/e3", "num_speculative_tokens": 4}'"""
    ) in body
    assert (
        "python -m sglang.launch_server --model org/model --speculative-algorithm EAGLE3 "
        "--speculative-draft-model-path out/e3 "
    ) in body
    assert "python -m decode.evaluate --target org/model --drafter out/e3 " in body
    one = model_card(CardFacts(fmt="eagle3", kind="eagle3", target="org/model", directory="d", engine="sglang"))
    meta, body = split(one)  # explicit ids in SGLang's convention: no vLLM command, the re-export named
    assert meta["license"] == "unknown" and "vllm" not in meta["tags"] and "vllm serve" not in body
    assert "--engine vllm" in body and NO_EVAL in body


@pytest.mark.parametrize("fmt", ["eagle3", "speculators", "native"])
def test_a_qwen3_draft_layer_card_names_vllm_only(fmt):
    """SGLang 0.5.23 has no Qwen3 EAGLE-3 class: no SGLang command, tag or library, whatever the layout."""
    meta, body = split(model_card(CardFacts(fmt=fmt, kind="eagle3", target="t", directory="d", vllm_only=True)))
    assert "sglang" not in meta["tags"] and meta["library_name"] != "sglang" and "sglang.launch_server" not in body
    assert "SGLang 0.5.23 has no EAGLE-3 drafter with a Qwen3 layer" in body
    assert "vllm serve t " in body  # a native checkpoint's after its export command


@pytest.mark.parametrize(
    "kind,fmt,library",
    [
        ("eagle3", "native", "draftsmith"),
        ("eagle3", "eagle3", "sglang"),
        ("eagle3", "speculators", "vllm"),
        ("medusa", "medusa-vllm", "vllm"),
        ("layerskip", "native", "draftsmith"),
    ],
)
def test_every_export_writes_a_card(tmp_path, target_dir, kind, fmt, library):
    module = build(kind, Target.load(target_dir))
    out = export(run_dir(tmp_path, module, target_dir), fmt, tmp_path / fmt)
    meta, body = split((out / "README.md").read_text())
    assert meta["base_model"] == str(target_dir) and meta["library_name"] == library
    assert meta["license"] == "apache-2.0"  # read from the target's own card
    assert {"speculative-decoding", "draftsmith", {"layerskip": "layerskip"}.get(kind, kind)} <= set(meta["tags"])
    assert [ln for ln in body.splitlines() if ln.startswith("## ")] == SECTIONS
    assert NO_EVAL in body and "| draft shape |" not in body  # the run recorded no evaluation
    assert f"python -m decode.evaluate --target {target_dir} --drafter {out} " in body
    assert not list(tmp_path.glob(f".{fmt}.*"))  # written in the export's atomic rename: no temp dir left
    if fmt == "medusa-vllm":  # one proposed token per head; SGLang has no Medusa
        assert f'"method": "medusa", "model": "{out}", "num_speculative_tokens": 3' in body
        assert "SGLang has no Medusa drafter" in body
    if kind == "layerskip":
        assert "vllm serve" not in body and "runs in draftsmith's decoder" in body


def test_tau_table_only_when_the_run_recorded_an_evaluation(tmp_path, target_dir):
    module = build("eagle3", Target.load(target_dir))
    run = run_dir(tmp_path, module, target_dir, RECIPE, TRAIN_ROWS)
    _, body = split((export(run, "eagle3", tmp_path / "a") / "README.md").read_text())
    assert NO_EVAL in body and "| draft shape |" not in body
    for line in (
        "- source: chats.jsonl",
        "- records: the first 100 records of the source",
        "- regeneration: every answer written by the target itself (temperature 0.7, top-p 0.95, at most 64",
        "- steps: 20 optimizer steps",
        "- batch: 4 sequences per process per micro-batch x 1",
        "- trained tokens: 3,000",
        "- precision: bf16 autocast",
        "- threads: 1 per process",
        "- time in training steps: 0 min 20 s",
    ):
        assert line in body
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*TRAIN_ROWS, EVAL_ROW]))
    (run / "report.json").write_text(
        json.dumps(
            {
                "settings": {"prompts": "mt.jsonl", "turns": 4, "max_new_tokens": 32, "temperature": 0.0},
                "drafters": [
                    {"name": "ar", "spec": "ar", "mean_accepted_tokens": 1.0, "speedup_vs_ar": 1.0},
                    {"name": "e3", "spec": "runs/e3", "mean_accepted_tokens": 1.75, "speedup_vs_ar": 1.31},
                ],
            }
        )
    )
    _, body = split((export(run, "eagle3", tmp_path / "b") / "README.md").read_text())
    assert NO_EVAL not in body
    assert "8 held-out prompts, greedy, 64 new tokens, draftsmith's decoder at step 20." in body
    assert "| chain k=8 | 1.50 |" in body and "| tree dynamic:topk=8,depth=6,nodes=24 | 2.00 |" in body
    assert "acceptance by depth (chain): 0.400, 0.100" in body and "held-out loss 2.5000" in body
    assert "| runs/e3 | 1.75 | 1.31x |" in body  # the run's report.json, speed column included


def test_target_licence_is_read_or_left_unknown(tmp_path):
    assert target_license(None) is None and target_license(tmp_path) is None
    (tmp_path / "LICENSE").write_text("\nMIT License\n\nCopyright ...\n")
    assert target_license(tmp_path) == "mit"
    (tmp_path / "LICENSE").write_text("Some custom terms\n")
    assert target_license(tmp_path) == "other"
    (tmp_path / "README.md").write_text("---\nlicense: llama3.1\n---\n")
    assert target_license(tmp_path) == "llama3.1"  # the Hub card wins over the LICENSE text


def test_a_fetched_source_is_named_as_the_recipe_named_it():
    """A card says `fetch:sharegpt-first-turns`, not the data home path the recipe resolved it to on one machine."""
    from train.data.identity import data_home
    from train.data.sharegpt import DATA_FILES

    assert FETCHED == {f"sharegpt/{f}": f"fetch:{n}" for n, f in DATA_FILES.items()}  # the two lists agree
    recipe = {"data": {"source": [str(data_home() / "sharegpt" / DATA_FILES["sharegpt-first-turns"]), "my.jsonl"]}}
    assert dict(data_rows(recipe))["source"] == "fetch:sharegpt-first-turns, my.jsonl"


def test_shipped_drafter_has_its_card():
    """recipes/smollm2-135m/drafters/eagle3 ships a card made by model_card from its config.json's record."""
    cfg = json.loads((SHIPPED / "config.json").read_text())
    meta, body = split((SHIPPED / "README.md").read_text())
    assert meta["base_model"] == cfg["draftsmith"]["target"] and meta["library_name"] == "sglang"
    assert {"speculative-decoding", "eagle3", "draftsmith"} <= set(meta["tags"])
    assert [ln for ln in body.splitlines() if ln.startswith("## ")] == SECTIONS
    mt = cfg["draftsmith"]["measured"]["mt_bench_80_first_turns_64_tokens_bf16"]
    assert f"| chain k=8 | {mt['tau_chain_k8']} |" in body
    assert f"| tree dynamic:topk=8,depth=6,nodes=24 | {mt['tau_tree_dynamic_topk8_depth6_nodes24']} |" in body
    assert "--speculative-draft-model-path recipes/smollm2-135m/drafters/eagle3" in body


SHIPPED_BLOCK = REPO / "recipes" / "smollm2-135m" / "drafters" / "dspark"
CHAT_TARGET = REPO / "recipes" / "targets" / "smollm2-135m-instruct"


def test_shipped_block_drafter_is_a_bf16_native_dspark_under_32_mb_with_its_card():
    """recipes/smollm2-135m/drafters/dspark: the best block drafter, a native DSpark checkpoint saved in bf16 with a
    16k draft vocabulary (the module loads it into fp32 or the target's dtype), with its card: the sections, the 80-turn figures recorded in
    its config.json, and no path of the machine that trained it."""
    from safetensors import safe_open

    cfg = json.loads((SHIPPED_BLOCK / "config.json").read_text())
    assert cfg["draftsmith_drafter"] == "dspark" and cfg["config"]["block_size"] == 8
    weights = SHIPPED_BLOCK / "model.safetensors"
    assert weights.stat().st_size < 32 * 2**20
    with safe_open(str(weights), "pt") as f:  # the draft vocabulary's maps stay index tensors
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {v for k, v in dtypes.items() if k not in ("d2t", "t2d")} == {"BF16"}
    assert (dtypes.get("d2t"), dtypes.get("t2d")) == ("I64", "BOOL") and cfg["config"]["draft_vocab_size"] == 16384
    meta, body = split((SHIPPED_BLOCK / "README.md").read_text())
    assert meta["base_model"] == cfg["target"]["name_or_path"] and "dspark" in meta["tags"]
    assert [ln for ln in body.splitlines() if ln.startswith("## ")] == SECTIONS
    mt = cfg["draftsmith"]["measured"]["mt_bench_80_first_turns_64_tokens_bf16"]
    assert f"| chain k=7 | {mt['tau_chain_k7']} |" in body
    assert "/root/" not in body + json.dumps(cfg) and "fetch:sharegpt-first-turns" in body


@pytest.mark.skipif(not (CHAT_TARGET / "model.safetensors").is_file(), reason="draftsmith fetch smollm2-135m-instruct")
def test_shipped_block_drafter_decodes_the_chat_target_losslessly():
    """On the fetched chat target in fp32 the shipped DSpark drafts 7-token chains and the output is AR's."""
    from decode.generate import encode_prompt, generate
    from decode.sampling import SamplingConfig
    from decode.tree import Shape
    from drafters.registry import make_drafter

    target = Target.load(CHAT_TARGET, dtype="float32")
    ids = encode_prompt(target, "Name three colours of the rainbow.")
    ar = generate(target, make_drafter("ar", target), ids, 24, SamplingConfig(), Shape())
    out = generate(
        target, make_drafter(str(SHIPPED_BLOCK), target), ids, 24, SamplingConfig(), Shape(kind="chain", k=7)
    )
    assert out.tokens == ar.tokens and out.stats.drafter_passes > 0
