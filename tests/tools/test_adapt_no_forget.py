"""tools/experiments/adapt_no_forget.py: detect's per-face figures against a per-image loop, and the
user's images chosen per class."""
from __future__ import annotations

import numpy as np

from tools.experiments.adapt_no_forget import USER_PER_CLASS, judge, markdown, user_split


def test_judge_counts_as_detect_decides_image_by_image():
    rng = np.random.default_rng(0)
    D, d, n = 12, 5, 40
    W, b = rng.normal(size=(D, d)), rng.normal(size=D)
    h, y = rng.normal(size=(n, d)), rng.integers(0, D, n)
    t = rng.normal(size=D).astype(np.float32)
    got = judge(h, y, W, b, t)
    own = hard = matches = 0
    for i in range(n):
        z = (h[i].astype(np.float32) @ W.T.astype(np.float32) + b.astype(np.float32))
        match = z >= t
        own += match[y[i]]
        matches += match.sum()
        wrong = max((j for j in range(D) if j != y[i]), key=lambda j: z[j])
        hard += match[wrong]
    assert got["recall"] == own / n and got["matches"] == matches
    assert got["precision"] == own / matches and got["hard_false_matches"] == hard / n


def test_the_users_images_are_two_per_class_seeded_and_the_rest_measured():
    y = np.repeat(np.arange(7), 8)
    user, rest = user_split(y, 3)
    assert np.array_equal(np.bincount(y[user]), np.full(7, USER_PER_CLASS))
    assert np.array_equal(np.sort(np.concatenate([user, rest])), np.arange(len(y)))
    assert np.array_equal(user, user_split(y, 3)[0]) and not np.array_equal(user, user_split(y, 4)[0])


def test_the_page_has_a_row_per_state_and_face():
    m = {"images": 10, "recall": 0.5, "precision": 0.9, "matches": 6, "hard_false_matches": 0.1}
    states = {s: {"A (test)": m, "B (held out)": m} for s in ("exported", "thresholds only",
                                                              "adapt (before: --no-adapt-keep)", "adapt keeping (default)")}
    r = {"bundle": "runs/x", "target": {"precision": 0.99}, "exported": {"A (test)": m}, "embed_seconds": 1,
         "seconds": 2, "seeds": [{"seed": s, "states": states, "notes": {"thresholds only": {"seconds": 1}}}
                                 for s in (0, 1)]}
    page = markdown(r, "slc experiment adapt-no-forget runs/x")
    assert page.count("| adapt keeping (default) |") == 2 and "0.000 ± 0.000" in page
