"""The report's short row labels (what the plots show) and the per-conversation spreads behind the whiskers."""

from __future__ import annotations

import pytest

from decode.harness.labels import distinct_labels, drafter_kind, label_of, per_conversation_tau, row_label, shape_label
from decode.harness.report import markdown

TREE = "dynamic:topk=8,depth=6,nodes=24"


def test_shape_labels():
    assert shape_label("chain k=8") == "chain 8" and shape_label(TREE) == "tree 24"
    assert shape_label("static nodes=9") == "static 9" and shape_label(None) == ""
    assert shape_label("dynamic:topk=4,depth=1,nodes=4") == "top-4"  # the root's top-k, one drafter call


@pytest.mark.parametrize(
    ("spec", "shape", "kind", "auto", "label"),
    [
        ("ar", None, None, False, "AR"),
        ("early-exit:4", "chain k=8", None, False, "early-exit:4 · chain 8"),
        (f"early-exit:4@{TREE}", TREE, None, False, "early-exit:4 · tree 24"),
        ("prompt-lookup:ngram=3", "chain k=8", None, False, "prompt-lookup"),  # its own trees: no shape
        ("lookahead", "chain k=8", None, True, "lookahead · auto"),
        (f"/runs/chat/eagle3/export@{TREE}", TREE, "eagle3", False, "eagle3 · tree 24"),
        ("/runs/chat/medusa/export@auto", "dynamic:topk=4,depth=3,nodes=8", "medusa", True, "medusa · auto: tree 8"),
        ("/runs/x/my-drafter", "chain k=3", None, False, "my-drafter · chain 3"),  # no kind: the directory's name
        ("draft-model:/models/tiny", "chain k=8", None, False, "draft-model · chain 8"),
        ("hf-prompt-lookup", None, None, False, "hf-prompt-lookup"),
    ],
)
def test_row_labels_are_kind_and_shape(spec, shape, kind, auto, label):
    assert row_label(spec, shape, kind, auto) == label


def test_label_of_a_report_entry_and_drafter_kind():
    entry = {"spec": "/a/b/export@auto", "shape": "chain k=2", "drafter_kind": "layerskip", "auto": {"shape": "x"}}
    assert label_of(entry) == "layerskip · auto: chain 2"
    assert drafter_kind("skip:3,5@chain") == "skip:3,5"


def test_per_conversation_tau_sums_turns_of_a_conversation():
    rows = [
        {"id": "a", "new_tokens": 10, "target_forward_passes": 5},
        {"id": "b", "new_tokens": 6, "target_forward_passes": 6},
        {"id": "a", "new_tokens": 2, "target_forward_passes": 3},
    ]
    assert per_conversation_tau({"prompts": rows}) == [12 / 8, 1.0]


def test_two_drafters_of_one_kind_get_distinct_labels():
    ds = [
        {"spec": s, "shape": "chain k=8", "drafter_kind": "eagle3", "auto": None}
        for s in ("runs/a/e3-2500", "recipes/x/drafters/eagle3/")
    ]
    ds.append({"spec": "ar", "shape": None, "drafter_kind": None, "auto": None})
    assert distinct_labels(ds) == {
        "runs/a/e3-2500": "eagle3 · chain 8 (e3-2500)",
        "recipes/x/drafters/eagle3/": "eagle3 · chain 8 (eagle3)",
        "ar": "AR",
    }


def test_every_row_of_two_drafters_of_one_kind_is_tagged_and_exports_go_by_their_run():
    ds = [
        {"spec": s, "shape": shape, "drafter_kind": "eagle3", "auto": auto}
        for s, shape, auto in (
            ("runs/2026-12-04/e3-5k/export", "chain k=8", None),
            ("runs/2026-12-04/e3-5k/export@auto", "dynamic:topk=4,depth=2,nodes=8", {"shape": "x"}),
            ("recipes/x/drafters/eagle3", "chain k=8", None),
            ("recipes/x/drafters/eagle3@auto", "dynamic:topk=4,depth=1,nodes=4", {"shape": "x"}),
        )
    ]
    ds += [
        {"spec": "early-exit:4", "shape": "chain k=8", "drafter_kind": "early-exit", "auto": None},
        {"spec": "early-exit:8", "shape": "chain k=8", "drafter_kind": "early-exit", "auto": None},
        {"spec": "runs/m/export", "shape": "chain k=8", "drafter_kind": "medusa", "auto": None},
    ]
    assert distinct_labels(ds) == {
        "runs/2026-12-04/e3-5k/export": "eagle3 · chain 8 (e3-5k)",
        "runs/2026-12-04/e3-5k/export@auto": "eagle3 · auto: tree 8 (e3-5k)",
        "recipes/x/drafters/eagle3": "eagle3 · chain 8 (eagle3)",
        "recipes/x/drafters/eagle3@auto": "eagle3 · auto: top-4 (eagle3)",
        "early-exit:4": "early-exit:4 · chain 8",
        "early-exit:8": "early-exit:8 · chain 8",
        "runs/m/export": "medusa · chain 8",
    }


def test_report_md_tells_two_drafters_of_one_kind_apart_in_every_table():
    # a regression: report.md's per-category and by-depth tables showed two `eagle3 · chain 8` rows, one per drafter
    def row(spec: str, shape: str, auto: dict | None) -> dict:
        return {
            "spec": spec,
            "name": spec,
            "shape": shape,
            "drafter_kind": "eagle3",
            "auto": auto,
            "time_split_s": None,
            "cost_model": None,
            "mean_accepted_tokens": 1.5,
            "tokens_per_s": 30.0,
            "speedup_vs_ar": 1.0,
            "matches_ar": None,
            "target_forward_passes": 1,
            "drafter_forward_passes": 1,
            "per_category": {"writing": {"mean_accepted_tokens": 1.5}},
            "acceptance_by_depth": [0.4, 0.2],
        }

    auto = {
        "shape": "dynamic:topk=4,depth=2,nodes=8",
        "predicted_tau": 1.9,
        "measured_tau": 1.9,
        "predicted_speedup_vs_ar": 1.4,
        "measured_speedup_vs_ar": 1.4,
        "calibration_cached": False,
        "calibration": None,
    }
    ds = [
        row("runs/a/export", "chain k=8", None),
        row("runs/a/export@auto", auto["shape"], auto),
        row("recipes/x/drafters/eagle3", "chain k=8", None),
    ]
    md = markdown({"settings": {}, "drafters": ds, "cost_model": {"target_pass_s": [], "formula": "f"}})
    tables = md.split("## τ per category")[1]
    assert tables.count("| eagle3 · chain 8 (a) |") == 2 and tables.count("| eagle3 · chain 8 (eagle3) |") == 2
    assert "| eagle3 · auto: tree 8 (a) | `dynamic:topk=4,depth=2,nodes=8` |" in tables
    assert "| eagle3 · chain 8 |" not in md
